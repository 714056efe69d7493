"""Where XLA put each kernel of a compiled program: prints every custom call of the optimized
HLO with the computation that holds it (ENTRY, a while body, a cond branch): e.g. which branch
of "auto"'s guard holds which kernel, or whether XLA hoisted a kernel out of a loop (NOTES.md
run 48 used it on a guard built as a loop).

    PYTHONPATH=. python3 benchmarks/hlo_kernels.py --shape 2x8192x16x128 --out $OUT
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_flash as pf  # noqa: E402


def kernel_sites(hlo: str) -> list[tuple[str, str, str]]:
    """[(computation, role, custom call line)]: role is "entry", "while body <name>", "while
    condition", "branch" or "other", from the while / conditional instructions that call it."""
    roles = {}
    for m in re.finditer(r"while\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)", hlo):
        roles[m.group(1)] = "while condition"
        roles[m.group(2)] = "while body"
    for m in re.finditer(r"branch_computations=\{([^}]*)\}", hlo):
        for name in m.group(1).split(","):
            roles[name.strip().lstrip("%")] = "branch"
    sites, current, role = [], None, "other"
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            current = header.group(2)
            role = "entry" if header.group(1) else roles.get(current, "other")
        elif "custom-call(" in line:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            name = re.search(r'"name":\s*"([^"]+)"|kernel_name[=:]\s*"?([\w.\-]+)', line)
            label = target.group(1) if target else "?"
            if name:
                label += " " + (name.group(1) or name.group(2))
            sites.append((current, role, label))
    return sites


def print_sites(sites, prefix: str = "") -> None:
    for computation, role, label in sites:
        print(f"{prefix}{role:16s} {computation:40s} {label[:120]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2x8192x16x128", help="batch x seq x heads x head_dim")
    p.add_argument("--causal", type=int, default=0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    b, s, h, d = (int(n) for n in args.shape.split("x"))
    x = jax.random.normal(jax.random.key(0), (b, s, h, d), jnp.bfloat16)

    def loss(q, k, v):
        out = pf.flash_attention(q, k, v, causal=bool(args.causal), backend=args.backend)
        return jnp.sum(out.astype(jnp.float32))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().as_text()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hlo.txt"), "w") as f:
        f.write(hlo)
    sites = kernel_sites(hlo)
    print_sites(sites)
    return sites


if __name__ == "__main__":
    main()
