"""Where a Mosaic kernel's CTA spends its time, from Mosaic GPU's on-device trace (GPU only).

    PYTHONPATH=. python3 benchmarks/kernel_trace.py --out DIR [--pass bwd|fwd]
        [--case 2x8192x16x16x128] [--causal 1,0] [--config "compute_registers=224"]

The kernels' named scopes are recorded per warpgroup and CTA, with the SM each CTA ran on, when
their config's profile folder is set (MosaicBackwardConfig.fused_profile_dir for the fused
backward, MosaicForwardConfig.profile_dir for the forward; common.profile_params). This script
times the kernel without the trace, runs it once with it, and reduces the trace (tens of MB)
to a few numbers, printed and written to <out>/kernel_trace_<pass>.json. Durations are in
kilocycles of the SM clock (`reduce_trace` says why):

  cta_kcyc       a CTA's life (first to last event of any warpgroup);
  per_cta_kcyc   per CTA, each scope of compute warpgroup 0 (and the copy warpgroup's
                 stream): K / V or Q waits, the step loop, the epilogue's waits;
  fit            steps = per_cta + kcyc_per_step x n_steps over the CTAs (n_steps from the mask
                 per tile; only where tiles differ, e.g. causal): per_cta is the part of the
                 step loop that does not grow with the tile (first adds' waits, pipeline fill);
  per_step       scopes entered once a step, by step index (the first 4 against the rest):
                 backward slot_wait (compute waits for the writer to free a dQ slot), ds_wait
                 (the two compute warpgroups exchange dS^T), chain_wait (the writer waits for
                 the tile below to add); forward k_wait, v_wait (the copy warpgroup is late);
  ghz_if_no_idle per SM, CTA kilocycles per microsecond of CTA starts: the clock, if no SM
                 idled between CTAs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import itertools
import json
import math
import os
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)



def forward_layout(compute_wgs: int = 2):
    """PASSES["fwd"] for a forward with `compute_wgs` compute warpgroups (the config field):
    the copy warpgroup comes after them."""
    return (compute_wgs + 1,
            [(0, "q_wait"), (0, "steps"), (0, "store_wait"), (compute_wgs, "stream")],
            [(0, "k_wait"), (0, "v_wait"), (1, "k_wait"), (1, "v_wait")])


# (warpgroups per CTA, scopes entered once per CTA, scopes entered once per step) by pass;
# the copy warpgroup is 2 in both kernels at their defaults, the writer 3 in the backward.
PASSES = {
    "bwd": (4, [(0, "kv_wait"), (0, "steps"), (0, "writer_tail"), (0, "store"), (2, "stream")],
            [(0, "slot_wait"), (0, "ds_wait"), (1, "ds_wait"), (3, "chain_wait")]),
    "fwd": forward_layout(),
}


def reduce_trace(events, grid: dict, steps_per_tile, which: str = "bwd", layout=None) -> dict:
    """The summary described in the module docstring, from a list of trace events (dicts with
    name, ph 'B' / 'E', ts, pid = 1 + SM, tid = 1 + warpgroup + warpgroups x CTA).

    Units: Mosaic GPU's profiler stamps a CTA's start with the global timer (ns) and each event
    with the SM's cycle counter, and writes ts = (start_ns + cycles since the warpgroup's
    first event) / 1e3. So durations inside a CTA are kilocycles (kcyc), and a CTA's start is
    in microseconds; the two do not mix (no gaps or makespan from them). `grid` maps the
    grid's axis names to sizes ({"head": .., "tile": .., "batch": ..}) and `steps_per_tile`
    gives the steps of each value of the "tile" axis; the CTA index's axis order is not
    documented, so every order is tried and the one under which the step loop fits best
    (R^2) is reported with the fit. `layout` replaces PASSES[which] (forward_layout for a
    forward with three compute warpgroups).
    """
    warpgroups, per_cta_scopes, per_step_scopes = layout or PASSES[which]
    spans = collections.defaultdict(list)       # (cta, wg, name) -> [kcycles, in order]
    first = collections.defaultdict(lambda: math.inf)
    last = collections.defaultdict(lambda: -math.inf)
    sm_of = {}
    stacks = collections.defaultdict(list)
    for ev in sorted(events, key=lambda e: (e["tid"], e["ts"], e["ph"] == "B")):
        cta, wg = divmod(ev["tid"] - 1, warpgroups)
        sm_of[cta] = ev["pid"] - 1
        first[cta] = min(first[cta], ev["ts"])
        last[cta] = max(last[cta], ev["ts"])
        if ev["ph"] == "B":
            stacks[(cta, wg)].append(ev)
        elif stacks[(cta, wg)]:
            begin = stacks[(cta, wg)].pop()
            spans[(cta, wg, begin["name"])].append(ev["ts"] - begin["ts"])
    ctas = sorted(sm_of)
    start_us = np.array([first[c] for c in ctas])
    life = np.array([last[c] - first[c] for c in ctas])
    sms = np.array([sm_of[c] for c in ctas])
    # Per SM, kilocycles of CTA life per microsecond between its first and last CTA's start:
    # the SM clock in GHz if the SM never idled between CTAs (less if it did).
    ghz = []
    for sm in set(sms.tolist()):
        idx = np.flatnonzero(sms == sm)
        order = idx[np.argsort(start_us[idx])]
        if len(order) > 1 and start_us[order[-1]] > start_us[order[0]]:
            ghz.append(life[order[:-1]].sum() / (start_us[order[-1]] - start_us[order[0]]))

    def total(cta, wg, name):
        return float(np.sum(spans.get((cta, wg, name), [0.0])))

    steps_time = np.array([total(c, 0, "steps") for c in ctas])
    fit = {}
    for perm in itertools.permutations(list(grid)):
        # perm[0] varies slowest, perm[-1] fastest.
        coords = np.unravel_index(np.asarray(ctas), [grid[n] for n in perm])
        n_steps = np.asarray(steps_per_tile)[coords[perm.index("tile")]].astype(float)
        if np.ptp(n_steps) == 0:
            fit = dict(order=None, kcyc_per_step=float(np.mean(steps_time / max(n_steps[0], 1))))
            break
        design = np.stack([np.ones_like(n_steps), n_steps], 1)
        coef, *_ = np.linalg.lstsq(design, steps_time, rcond=None)
        resid = steps_time - design @ coef
        r2 = 1 - np.sum(resid ** 2) / np.sum((steps_time - steps_time.mean()) ** 2)
        if not fit or r2 > fit["r2"]:
            fit = dict(order=list(perm), per_cta_kcyc=float(coef[0]),
                       kcyc_per_step=float(coef[1]), r2=float(r2))

    def by_index(wg, name):
        seqs = [spans.get((c, wg, name), []) for c in ctas]
        head = [s[i] for s in seqs for i in range(min(4, len(s)))]
        rest = [x for s in seqs for x in s[4:]]
        return dict(first4_kcyc=float(np.mean(head)) if head else 0.0,
                    rest_kcyc=float(np.mean(rest)) if rest else 0.0,
                    per_cta_kcyc=float(np.mean([sum(s) for s in seqs])))

    return dict(
        ctas=len(ctas), sms=len(set(sms.tolist())),
        ghz_if_no_idle=float(np.median(ghz)) if ghz else None,
        cta_kcyc=float(np.mean(life)),
        per_cta_kcyc={f"wg{wg}.{name}": float(np.mean([total(c, wg, name) for c in ctas]))
                      for wg, name in per_cta_scopes},
        fit=fit,
        per_step={f"wg{wg}.{name}": by_index(wg, name) for wg, name in per_step_scopes})


def main():
    import jax
    import jax.numpy as jnp
    from jax import lax

    import pallas_flash as pf
    from benchmarks.check_log import timed
    from benchmarks.mosaic_tune import named_configs
    from pallas_flash import bench
    from pallas_flash.masking import make_mask_spec
    from pallas_flash.mosaic import backward as mb
    from pallas_flash.mosaic import forward as mf
    from pallas_flash.mosaic import fused_backward as fb
    from pallas_flash.spec import AttentionSpec
    from pallas_flash.triton import forward as tf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pass", dest="which", choices=sorted(PASSES), default="bwd")
    p.add_argument("--case", default="2x8192x16x16x128")
    p.add_argument("--causal", default="1,0")
    p.add_argument("--config", default="",
                   help="overrides of the default config, 'field=value,...' (ints, 0/1 for bools, none)")
    p.add_argument("--trace-dir", default="/tmp/kernel_trace")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    results = []
    for causal in (bool(int(x)) for x in args.causal.split(",")):
        case = bench.Case(*bench.parse_case(args.case), causal=causal)
        q, k, v, do = bench.make_inputs(case, jnp.bfloat16, jax.random.key(0))
        d, s = case.head_dim, case.seq
        mask = make_mask_spec(s, s, causal=causal)
        spec = AttentionSpec(mask=mask, scale=1.0 / math.sqrt(d), softcap=None,
                             has_segments=False, precision=lax.Precision.DEFAULT,
                             config=pf.default_config(d, jnp.bfloat16), interpret=False)
        base = (mb.default_backward_config(d) if args.which == "bwd"
                else mf.default_forward_config(d))
        cfg, = named_configs(base, args.config)
        folder = "fused_profile_dir" if args.which == "bwd" else "profile_dir"
        traced_cfg = dataclasses.replace(cfg, **{folder: args.trace_dir})
        n_heads = case.kv_heads
        layout = None
        if args.which == "bwd":
            out, st = jax.jit(lambda q, k, v: tf.forward(spec, q, k, v))(q, k, v)
            dlse = jax.random.normal(jax.random.key(1), st.m.shape, jnp.float32)
            operands = (q, k, v, out, st, do, dlse)
            run = lambda c: jax.jit(lambda *a: mb.backward(spec, *a, config=c))  # noqa: E731
            n_tiles = -(-s // fb.CTA_KEYS)
            with jax.ensure_compile_time_eval():
                lo, _, _, hi = jax.vmap(lambda x: mask.q_blocks(x, fb.CTA_KEYS, fb.BLOCK_Q, s, s))(
                    jnp.arange(n_tiles, dtype=jnp.int32) * fb.CTA_KEYS)
            steps = np.asarray(hi - lo) * (case.q_heads // case.kv_heads)
        else:
            operands = (q, k, v)
            run = lambda c: jax.jit(lambda *a: mf.forward(spec, *a, config=c))  # noqa: E731
            rows = cfg.cta_rows
            n_tiles = -(-s // rows)
            with jax.ensure_compile_time_eval():
                lo, _, _, hi = jax.vmap(lambda x: mask.kv_blocks(x, rows, cfg.block_kv, s))(
                    jnp.arange(n_tiles, dtype=jnp.int32) * rows)
            steps = np.asarray(hi - lo)
            if mask.right is not None:      # common.grid_position: last tiles first
                steps = steps[::-1]
            n_heads = case.q_heads
            layout = forward_layout(cfg.compute_wgs)
        _, t_plain = timed(run(cfg), operands, 10)
        shutil.rmtree(args.trace_dir, ignore_errors=True)
        os.makedirs(args.trace_dir)
        jax.block_until_ready(run(traced_cfg)(*operands))     # compiles, traces once
        jax.effects_barrier()
        files = sorted(glob.glob(os.path.join(args.trace_dir, "*.json")))
        with open(files[0]) as f:
            events = json.load(f)["traceEvents"]
        grid = dict(head=n_heads, tile=n_tiles, batch=case.batch)
        if args.which == "bwd":     # the fused kernel's grid, head chunks included
            grid = dict(zip(("head", "tile", "batch"), fb._grid(
                n_heads, n_tiles, case.batch, fb.head_chunk(cfg, case.batch, n_heads))))
        row = dict(which=args.which, case=args.case, causal=causal, config=repr(cfg),
                   ms=t_plain * 1e3, events=len(events), mean_steps=float(np.mean(steps)),
                   **reduce_trace(events, grid, steps, args.which, layout))
        results.append(row)
        print(json.dumps(row, indent=1), flush=True)
    with open(os.path.join(args.out, f"kernel_trace_{args.which}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
