"""A data- and context-parallel training step: a tiny causal LM on `pallas_flash.ring_attention`.

The mesh has two axes: "data" splits the batch and "context" splits the sequence. Every array
of activations is [batch, seq, ...] sharded as P("data", "context"); the weights are replicated.
Everything in the model is position-wise except attention, so `jax.jit` partitions it with no
communication at all, and attention is `ring_attention` over the "context" axis (causal, with
the batch split over "data"). The gradients of the replicated weights are summed over both axes
by the all-reduces that jit inserts on its own.

Load balance: with causal attention the zig-zag layout gives every context device the same
work. The batch is permuted into that layout once, on the host, with `zigzag_permute`: the
input tokens, their next-token targets and their position ids alike (RoPE reads the position
ids, so the model never assumes that tokens are in order). The loss is a mean over tokens, so
it does not care about their order and nothing is ever permuted back.

The data is synthetic (no downloads): each sequence repeats one random pattern, so the next
token can be copied from one period back, and attention has something to learn across the
context shards. With `--check-steps N` the script replays the first N steps on one device with
`flash_attention` in natural token order, from the same initialisation and data, and compares
the losses.

Usage (from the repository root):

    python examples/sharded_train_step.py                          # 2 x 2 mesh, CPU devices
    python examples/sharded_train_step.py --data 1 --context 4 --steps 20

On a CPU the script asks XLA for `data * context` host devices (unless XLA_FLAGS already sets
a count), so it runs anywhere; the kernels then run in Pallas interpret mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from pathlib import Path


def _request_host_devices(argv) -> None:
    """Fake CPU devices for the mesh. XLA reads the flag once, when JAX starts its CPU backend,
    so this must happen before `import jax`; a count already in XLA_FLAGS is left alone."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    args, _ = _parser().parse_known_args(argv)
    count = max(4, args.data * args.context)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=int, default=2, help="devices on the 'data' mesh axis")
    parser.add_argument("--context", type=int, default=2,
                        help="devices on the 'context' mesh axis (the attention ring)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (global)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (global)")
    parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-steps", type=int, default=0,
                        help="replay this many steps on one device and compare the losses")
    return parser


# Before `import jax`; a no-op when JAX is already running (e.g. imported by a test).
_request_host_devices(sys.argv[1:] if __name__ == "__main__" else [])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

try:
    import pallas_flash
except ImportError:
    # Run from a source checkout without an install: the package sits one directory up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pallas_flash


@dataclasses.dataclass(frozen=True)
class Model:
    vocab: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: 2 q heads per kv head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# ------------------------------------------------------------------------------------------------
# Model: pre-norm blocks of GQA attention (RoPE) and a GELU MLP; attention is a parameter.
# ------------------------------------------------------------------------------------------------


def init_params(model: Model, key) -> dict:
    d, hd = model.d_model, model.head_dim

    def dense(key, fan_in, fan_out):
        return jax.random.normal(key, (fan_in, fan_out), jnp.float32) * fan_in**-0.5

    def layer(key):
        keys = jax.random.split(key, 6)
        return {
            "wq": dense(keys[0], d, model.n_heads * hd),
            "wk": dense(keys[1], d, model.n_kv_heads * hd),
            "wv": dense(keys[2], d, model.n_kv_heads * hd),
            "wo": dense(keys[3], model.n_heads * hd, d) / math.sqrt(2 * model.n_layers),
            "w_in": dense(keys[4], d, 4 * d),
            "w_out": dense(keys[5], 4 * d, d) / math.sqrt(2 * model.n_layers),
        }

    k_embed, k_layers, k_head = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k_embed, (model.vocab, d), jnp.float32),
        # Stacked on a leading axis and scanned, so compile time does not grow with depth.
        "layers": jax.vmap(layer)(jax.random.split(k_layers, model.n_layers)),
        "head": dense(k_head, d, model.vocab) * 0.1,
    }


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x, positions):
    """Rotary embedding at explicit positions [batch, seq], whatever order the tokens are in."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freqs
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _block(model: Model, attention, positions, x, p):
    b, s, _ = x.shape
    h = _norm(x)
    q = _rope((h @ p["wq"]).reshape(b, s, model.n_heads, model.head_dim), positions)
    k = _rope((h @ p["wk"]).reshape(b, s, model.n_kv_heads, model.head_dim), positions)
    v = (h @ p["wv"]).reshape(b, s, model.n_kv_heads, model.head_dim)
    x = x + attention(q, k, v).reshape(b, s, -1) @ p["wo"]
    return x + jax.nn.gelu(_norm(x) @ p["w_in"]) @ p["w_out"]


def loss_fn(model: Model, attention, params, inputs, targets, positions):
    """Mean next-token cross-entropy. Token order does not matter to it: positions say where
    each token is, and the mean is over all of them."""
    x = params["embed"][inputs]
    x, _ = jax.lax.scan(lambda x, p: (_block(model, attention, positions, x, p), None), x,
                        params["layers"])
    logits = _norm(x) @ params["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _adam(params, grads, state, lr, b1=0.9, b2=0.99, eps=1e-8):
    step, mu, nu = state
    step = step + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
    nu = jax.tree.map(lambda n, g: b2 * n + (1 - b2) * g * g, nu, grads)
    # Bias-corrected moments: both start at zero.
    m_hat = lambda m: m / (1 - b1**step)  # noqa: E731
    n_hat = lambda n: n / (1 - b2**step)  # noqa: E731
    params = jax.tree.map(lambda p, m, n: p - lr * m_hat(m) / (jnp.sqrt(n_hat(n)) + eps),
                          params, mu, nu)
    return params, (step, mu, nu)


def make_train_step(model: Model, attention, lr: float, shardings=None):
    """A jitted (params, opt_state, inputs, targets, positions) -> (params, opt_state, loss).

    shardings: (replicated, tokens) NamedShardings for the sharded step, or None for one
    device. The weights and optimiser state stay replicated; the token arrays keep
    P("data", "context"), and jit derives every other layout from them.
    """

    def step(params, opt_state, inputs, targets, positions):
        loss, grads = jax.value_and_grad(functools.partial(loss_fn, model, attention))(
            params, inputs, targets, positions)
        params, opt_state = _adam(params, grads, opt_state, lr)
        return params, opt_state, loss

    if shardings is None:
        return jax.jit(step)
    replicated, tokens = shardings
    return jax.jit(step, in_shardings=(replicated, replicated, tokens, tokens, tokens),
                   out_shardings=(replicated, replicated, replicated))


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


def make_batch(rng: np.random.Generator, vocab: int, batch: int, seq: int, period: int = 8,
               seed: int = 0):
    """(inputs, targets, positions), int32 [batch, seq], in natural order.

    Each sequence repeats one pattern of `period` tokens, a walk on a fixed random graph where
    every token has two successors: the next token is half-predictable from the current one
    (the loss falls within a few steps) and, from the second period on, a copy of the token one
    period back (what attention can learn, across context shards).
    """
    successors = np.random.default_rng([seed, 1]).integers(0, vocab, size=(vocab, 2))
    walk = np.empty((batch, period), np.int64)
    walk[:, 0] = rng.integers(0, vocab, size=batch)
    for t in range(1, period):
        walk[:, t] = successors[walk[:, t - 1], rng.integers(0, 2, size=batch)]
    tokens = np.tile(walk, (1, -(-(seq + 1) // period)))[:, : seq + 1].astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    return tokens[:, :-1], tokens[:, 1:], positions


# ------------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------------


def make_mesh(data: int, context: int):
    devices = jax.devices()
    if data * context > len(devices):
        raise SystemExit(f"a {data} x {context} mesh needs {data * context} devices; "
                         f"{len(devices)} are visible")
    return jax.make_mesh((data, context), ("data", "context"),
                         axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: data * context])


def train(args, sharded: bool, steps: int) -> list[float]:
    model = Model()
    params = init_params(model, jax.random.PRNGKey(args.seed))
    opt_state = (jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params),
                 jax.tree.map(jnp.zeros_like, params))
    if sharded:
        mesh = make_mesh(args.data, args.context)
        attention = functools.partial(pallas_flash.ring_attention, mesh=mesh,
                                      axis_name="context", batch_axis="data", causal=True,
                                      layout=args.layout)
        shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data", "context")))
        train_step = make_train_step(model, attention, args.lr, shardings)
        params, opt_state = jax.device_put((params, opt_state), shardings[0])
    else:
        attention = functools.partial(pallas_flash.flash_attention, causal=True)
        train_step = make_train_step(model, attention, args.lr)

    rng = np.random.default_rng(args.seed)  # the same batches for both runs
    losses = []
    for i in range(steps):
        batch = make_batch(rng, model.vocab, args.batch, args.seq, seed=args.seed)
        if sharded:
            if args.layout == "zigzag":
                batch = tuple(np.asarray(pallas_flash.zigzag_permute(x, args.context, axis=1))
                              for x in batch)
            batch = jax.device_put(batch, shardings[1])
        params, opt_state, loss = train_step(params, opt_state, *batch)
        losses.append(float(loss))
        print(f"{'sharded' if sharded else 'single '} step {i:3d}  loss {losses[-1]:.4f}")
    return losses


def main(argv: list[str] | None = None) -> dict:
    """Trains on the mesh and returns {"losses", "single_device_losses", "max_rel_diff"}
    (the last two None without --check-steps)."""
    args = _parser().parse_args(argv)
    chunks = args.context * (2 if args.layout == "zigzag" else 1)
    if args.seq % chunks:
        raise SystemExit(f"--seq {args.seq} must be divisible by {chunks} for the "
                         f"{args.layout} layout over {args.context} context devices")
    print(f"mesh data={args.data} x context={args.context} on {jax.default_backend()}, "
          f"batch {args.batch} x seq {args.seq}, {args.layout} layout")
    losses = train(args, sharded=True, steps=args.steps)
    result = {"losses": losses, "single_device_losses": None, "max_rel_diff": None}
    if args.check_steps:
        single = train(args, sharded=False, steps=min(args.check_steps, args.steps))
        diffs = [abs(a - b) / abs(b) for a, b in zip(losses, single)]
        result.update(single_device_losses=single, max_rel_diff=max(diffs))
        print(f"largest relative loss difference to one device: {max(diffs):.2e}")
    return result


# The largest relative loss difference to one device that --check-steps accepts: the two differ
# in summation order (and, on a GPU, in TF32 rounding).
CHECK_RTOL = 1e-3

if __name__ == "__main__":
    out = main()
    finite = all(math.isfinite(x) for x in out["losses"])
    agrees = out["max_rel_diff"] is None or out["max_rel_diff"] <= CHECK_RTOL
    sys.exit(0 if finite and agrees else 1)
