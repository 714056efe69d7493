"""Sample from the byte-level language model of `examples/train_lm.py` with a K/V cache.

Prefill. The prompts (a batch of byte strings of any lengths, right-padded) go through the same
model forward as training, `pallas_flash.flash_attention(..., causal=True)`: padding sits after
each prompt's last byte, so causality already hides it. Every layer's K and V are written into
that layer's cache, and the logits at each prompt's last byte give its first new token.

Decode. One jitted `lax.scan` step per new token: embed the token, and in each layer project
it, write its K and V at the sequence's own position with `lax.dynamic_update_slice`, and attend
with `pallas_flash.decode_attention` over the first `kv_lengths` positions of the cache. The
caches are donated to the jitted loop and carried through the scan, so XLA updates them in
place. Sampling: temperature and top-k from a PRNG key; temperature 0 is greedy.

Caches. Contiguous: one [batch, max_len, kv_heads, head_dim] array per layer for K and for V.
Paged (`--paged`): one pool of [num_pages, page_size, kv_heads, head_dim] per layer, and a block
table [batch, pages_per_seq] built on the host that hands each sequence pages in a shuffled
order, as a serving system's allocator would.

Check. `--check` decodes greedily twice: with the cache, and by re-running the full model
forward (flash attention, no cache) over every sequence after each new token. The logits must
match within a tolerance suited to the compute dtype, and with them the tokens, but for a near
tie that rounding flips (after which the sequences differ and are compared no further).

Usage (from the repository root):

    python examples/generate.py                  # trains the tiny preset briefly, then samples
    python examples/train_lm.py --save lm.npz && python examples/generate.py --checkpoint lm.npz
    python examples/generate.py --prompt "Romeo." --prompt "Ham." --tokens 200 \\
        --temperature 0.8 --top-k 40
    python examples/generate.py --paged --page-size 16 --check
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_lm  # noqa: E402  (the model, its params and its checkpoints)

pallas_flash = train_lm.pallas_flash

# Speakers as the training text names them: a name and a full stop on a line of their own.
DEFAULT_PROMPTS = ("Romeo.\n", "1 Citizen.\nWe are", "Ham.\nNo, ")
# Relative Frobenius error allowed between the cached and the full-forward logits: float32 in
# interpret mode differs only in summation order, a GPU multiplies float32 in TF32 (as XLA does
# by default), and bfloat16 rounds K/V and activations at different points.
_CHECK_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}
_CHECK_RTOL_TF32 = 5e-3


def check_rtol(dtype: str) -> float:
    if dtype == "float32" and jax.default_backend() == "gpu":
        return _CHECK_RTOL_TF32
    return _CHECK_RTOL.get(dtype, _CHECK_RTOL["bfloat16"])


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Where a sequence's K/V positions live (hashable: a jit static)."""

    batch: int
    max_len: int  # positions per sequence; a multiple of page_size when paged
    page_size: int | None = None  # None: contiguous

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def pages_per_seq(self) -> int:
        return self.max_len // self.page_size

    def cache_shape(self, cfg: train_lm.Config) -> tuple[int, ...]:
        rows, slots = ((self.batch * self.pages_per_seq, self.page_size) if self.paged
                       else (self.batch, self.max_len))
        return (rows, slots, cfg.n_kv_heads, cfg.head_dim)


def make_layout(batch: int, needed: int, page_size: int | None) -> CacheLayout:
    if page_size is None:
        return CacheLayout(batch, needed)
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    return CacheLayout(batch, -(-needed // page_size) * page_size, page_size)


def make_block_table(layout: CacheLayout, seed: int) -> np.ndarray | None:
    """[batch, pages_per_seq] int32 page ids: every page once, in a shuffled order, so that no
    sequence's pages are contiguous in the pool."""
    if not layout.paged:
        return None
    pages = np.random.default_rng(seed).permutation(layout.batch * layout.pages_per_seq)
    return pages.reshape(layout.batch, layout.pages_per_seq).astype(np.int32)


def encode_prompts(prompts: list[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [batch, width] right-padded with zeros, lengths [batch]) of UTF-8 prompts."""
    encoded = [np.frombuffer(p.encode(), np.uint8) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("prompts must not be empty")
    tokens = np.zeros((len(encoded), width), np.int32)
    for i, e in enumerate(encoded):
        tokens[i, : len(e)] = e
    return tokens, np.array([len(e) for e in encoded], np.int32)


def _layer(p: dict, i: int) -> dict:
    return jax.tree.map(lambda a: a[i], p["layers"])


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: int | None):
    """Next tokens [batch] from float32 logits [batch, vocab]; temperature 0 is greedy.

    The temperature is traced, so greedy and sampled runs share one compiled loop."""
    greedy = jnp.argmax(logits, axis=-1)
    logits = logits / jnp.maximum(temperature, 1e-6)
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    drawn = jax.random.categorical(key, logits)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# Prefill and decode
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1))
def prefill(cfg: train_lm.Config, layout: CacheLayout, params: dict, tokens: jax.Array,
            lengths: jax.Array, block_table: jax.Array | None):
    """(caches, logits [batch, vocab] at each prompt's last byte) for prompts [batch, width].

    caches = {"k": (one array per layer), "v": (...)} of layout.cache_shape(cfg); positions past
    a prompt hold its padding's K/V until decoding overwrites them, and kv_lengths hides them.
    """
    p = train_lm.compute_params(cfg, params)
    batch, width = tokens.shape
    x = train_lm.embed(p, tokens)
    caches = {"k": [], "v": []}
    for i in range(cfg.n_layers):
        q, k, v = train_lm.attention_inputs(cfg, x, _layer(p, i))
        x = train_lm.attention_output(cfg, x, train_lm.flash_attention(q, k, v), _layer(p, i))
        for name, new in (("k", k), ("v", v)):
            cache = jnp.zeros(layout.cache_shape(cfg), p["embed"].dtype)
            if layout.paged:
                # The prompt width is a whole number of pages (see generate): page j of
                # sequence b goes to pool row block_table[b, j].
                pages = new.reshape(batch, width // layout.page_size, *cache.shape[1:])
                cache = cache.at[block_table[:, : pages.shape[1]]].set(pages)
            else:
                cache = jax.lax.dynamic_update_slice(cache, new, (0, 0, 0, 0))
            caches[name].append(cache)
    logits = train_lm.unembed(p, x)[jnp.arange(batch), lengths - 1]
    return {n: tuple(c) for n, c in caches.items()}, logits


def write_token(cache: jax.Array, new: jax.Array, positions: jax.Array,
                block_table: jax.Array | None, page_size: int | None) -> jax.Array:
    """`cache` with new [batch, 1, kv_heads, head_dim] written at each sequence's position."""
    batch = new.shape[0]
    if block_table is None:
        rows, slots = jnp.arange(batch), positions
    else:
        rows = block_table[jnp.arange(batch), positions // page_size]
        slots = positions % page_size

    def one(b, cache):
        # A [1, 1, kv_heads, head_dim] slice: XLA updates the donated buffer in place.
        return jax.lax.dynamic_update_slice(cache, new[b][None].astype(cache.dtype),
                                            (rows[b], slots[b], 0, 0))

    return jax.lax.fori_loop(0, batch, one, cache)


def decode_step(cfg: train_lm.Config, layout: CacheLayout, p: dict, caches: dict,
                tokens: jax.Array, positions: jax.Array, block_table: jax.Array | None):
    """(caches, logits [batch, vocab]) after feeding tokens [batch] at positions [batch]."""
    x = train_lm.embed(p, tokens[:, None])
    new_caches = {"k": [], "v": []}
    for i in range(cfg.n_layers):
        lp = _layer(p, i)
        q, k, v = train_lm.attention_inputs(cfg, x, lp, positions=positions[:, None])
        kc = write_token(caches["k"][i], k, positions, block_table, layout.page_size)
        vc = write_token(caches["v"][i], v, positions, block_table, layout.page_size)
        o = pallas_flash.decode_attention(q, kc, vc, kv_lengths=positions + 1,
                                          block_table=block_table, scale=cfg.head_dim ** -0.5)
        x = train_lm.attention_output(cfg, x, o, lp)
        new_caches["k"].append(kc)
        new_caches["v"].append(vc)
    logits = train_lm.unembed(p, x)[:, 0]
    return {n: tuple(c) for n, c in new_caches.items()}, logits


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
def decode(cfg: train_lm.Config, layout: CacheLayout, steps: int, top_k: int | None,
           params: dict, caches: dict, first_logits: jax.Array, lengths: jax.Array,
           block_table: jax.Array | None, key: jax.Array, temperature: jax.Array):
    """(tokens [batch, steps], logits [batch, steps, vocab], caches): token t of each sequence
    sampled from logits t, the first from the prefill's logits."""
    p = train_lm.compute_params(cfg, params)
    key, first_key = jax.random.split(key)
    first = sample(first_logits, first_key, temperature, top_k)

    def step(carry, step_key):
        caches, token, positions = carry
        caches, logits = decode_step(cfg, layout, p, caches, token, positions, block_table)
        nxt = sample(logits, step_key, temperature, top_k)
        return (caches, nxt, positions + 1), (nxt, logits)

    (caches, _, _), (tokens, logits) = jax.lax.scan(
        step, (caches, first, lengths), jax.random.split(key, steps - 1))
    tokens = jnp.concatenate([first[None], tokens], axis=0).T
    logits = jnp.concatenate([first_logits[None], logits], axis=0).transpose(1, 0, 2)
    return tokens, logits, caches


_EXECUTABLES: dict = {}


def _compiled(fn, statics: tuple, args: tuple):
    """`fn` compiled ahead of time for `statics` and the shapes of `args`, once per process, so
    that the calls can be timed without their compilation."""
    leaves, tree = jax.tree.flatten(args)
    key = (fn, statics, tree, tuple((x.shape, x.dtype) for x in leaves))
    if key not in _EXECUTABLES:
        _EXECUTABLES[key] = fn.lower(*statics, *args).compile()
    return _EXECUTABLES[key]


def generate(cfg: train_lm.Config, params: dict, prompts: list[str], steps: int, *,
             temperature: float = 0.0, top_k: int | None = None, page_size: int | None = None,
             seed: int = 0) -> dict:
    """Samples `steps` bytes after each prompt. Returns `tokens` [batch, steps] and `logits`
    [batch, steps, 256] (numpy), `texts`, and `prefill_s` / `decode_s` (compilation excluded)."""
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    width = max(len(p.encode()) for p in prompts)
    if page_size is not None:
        width = -(-width // page_size) * page_size  # prefill writes whole pages
    tokens, lengths = encode_prompts(prompts, width)
    layout = make_layout(len(prompts), max(width, int(lengths.max()) + steps), page_size)
    table = make_block_table(layout, seed)
    table = None if table is None else jnp.asarray(table)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    key = jax.random.key(seed)

    args = (params, tokens, lengths, table)
    run_prefill = _compiled(prefill, (cfg, layout), args)
    start = time.perf_counter()
    caches, first_logits = jax.block_until_ready(run_prefill(*args))
    prefill_s = time.perf_counter() - start

    args = (params, caches, first_logits, lengths, table, key, jnp.float32(temperature))
    run_decode = _compiled(decode, (cfg, layout, steps, top_k), args)
    start = time.perf_counter()
    out, logits, _ = jax.block_until_ready(run_decode(*args))
    decode_s = time.perf_counter() - start
    out = np.asarray(out)
    return {"tokens": out, "logits": np.asarray(logits), "layout": layout,
            "texts": [bytes(row.astype(np.uint8)).decode(errors="replace") for row in out],
            "prefill_s": prefill_s, "decode_s": decode_s}


@functools.lru_cache(maxsize=None)
def _full_forward(cfg: train_lm.Config):
    return jax.jit(functools.partial(train_lm.forward, cfg, train_lm.flash_attention))


def greedy_by_full_forward(cfg: train_lm.Config, params: dict, prompts: list[str],
                           steps: int) -> dict:
    """Greedy decoding without a cache: after every new token, the full model forward over
    every sequence so far. One padded shape for all steps, so it compiles once."""
    tokens, lengths = encode_prompts(prompts, max(len(p.encode()) for p in prompts) + steps)
    forward = _full_forward(cfg)
    rows = np.arange(len(prompts))
    out, all_logits = [], []
    for t in range(steps):
        logits = np.asarray(forward(params, jnp.asarray(tokens)))[rows, lengths + t - 1]
        nxt = logits.argmax(-1).astype(np.int32)
        tokens[rows, lengths + t] = nxt
        out.append(nxt)
        all_logits.append(logits)
    return {"tokens": np.stack(out, 1), "logits": np.stack(all_logits, 1)}


def check_against_full_forward(cfg: train_lm.Config, params: dict, prompts: list[str],
                               steps: int, page_size: int | None = None,
                               rtol: float | None = None) -> dict:
    """Greedy with the cache against greedy by full forwards (see `compare_greedy`)."""
    cached = generate(cfg, params, prompts, steps, page_size=page_size)
    full = greedy_by_full_forward(cfg, params, prompts, steps)
    rtol = check_rtol(cfg.dtype) if rtol is None else rtol
    return {**compare_greedy(cached, full, rtol), "cached": cached, "full": full}


def compare_greedy(cached: dict, full: dict, rtol: float) -> dict:
    """Passes when the logits agree within `rtol` (relative Frobenius error) up to and including
    the first step whose tokens differ, if any: after it the sequences differ. A token can only
    differ where its two candidates' logits are closer than the two paths' logits are to each
    other, a near tie that rounding flips (never in interpret mode; possibly under TF32)."""
    same = cached["tokens"] == full["tokens"]
    diverge = None if same.all() else int(np.argmin(same.all(axis=0)))
    upto = same.shape[1] if diverge is None else diverge + 1
    a, b = cached["logits"][:, :upto], full["logits"][:, :upto]
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return {"passed": rel <= rtol, "rel_err": rel, "rtol": rtol, "first_divergence": diverge,
            "max_abs_diff": float(np.abs(a - b).max())}


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path,
                        help="parameters from `train_lm.py --save PATH`; without it, the tiny "
                             "preset is trained for --train-steps first")
    parser.add_argument("--train-steps", type=int, default=150,
                        help="steps of the in-process training without --checkpoint")
    parser.add_argument("--prompt", action="append",
                        help="a prompt (repeat for a batch); default: three Shakespeare openings")
    parser.add_argument("--tokens", type=int, default=120, help="bytes to sample per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="0: no top-k cut")
    parser.add_argument("--seed", type=int, default=0, help="sampling key and block table")
    parser.add_argument("--paged", action="store_true", help="a paged cache and a block table")
    parser.add_argument("--page-size", type=int, default=16, help="keys per page with --paged")
    parser.add_argument("--check", action="store_true",
                        help="also decode greedily with and without the cache and compare")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.train_steps < 1 or args.temperature < 0 or args.top_k < 0:
        parser.error("--tokens and --train-steps must be positive, --temperature and --top-k "
                     "not negative")
    if args.top_k > 256:
        parser.error(f"--top-k must be at most 256 (the byte vocabulary), got {args.top_k}")
    if args.paged and (args.page_size < 16 or args.page_size & (args.page_size - 1)):
        # decode_attention's pages: a power of two of at least 16 keys.
        parser.error(f"--page-size must be a power of two >= 16, got {args.page_size}")
    return args


def load_or_train(args) -> tuple[train_lm.Config, dict]:
    if args.checkpoint is not None:
        cfg, params = train_lm.load_checkpoint(args.checkpoint)
        print(f"checkpoint {args.checkpoint}: d_model {cfg.d_model}, {cfg.n_layers} layers, "
              f"{cfg.n_heads} q / {cfg.n_kv_heads} kv heads of {cfg.head_dim}, {cfg.dtype}")
        return cfg, params
    cfg = train_lm.build_config(train_lm.parse_args(
        ["--preset", "tiny", "--steps", str(args.train_steps)]))
    print(f"no checkpoint: training the tiny preset for {cfg.steps} steps first")
    data = train_lm.TextData(cfg, train_lm.DEFAULT_TEXT.read_bytes())
    run = train_lm.train(cfg, train_lm.flash_attention, data, cfg.steps, "train",
                         log_every=max(1, cfg.steps // 3), evaluate=False, show_progress=False)
    return cfg, run["params"]


def main(argv: list[str] | None = None) -> dict:
    """Samples and prints; returns {"texts", "tokens", "check" (None without --check), "ok"}."""
    args = parse_args(argv)
    cfg, params = load_or_train(args)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    page_size = args.page_size if args.paged else None
    result = generate(cfg, params, prompts, args.tokens, temperature=args.temperature,
                      top_k=args.top_k or None, page_size=page_size, seed=args.seed)
    layout = result["layout"]
    cache = (f"paged, {layout.pages_per_seq} pages of {layout.page_size} per sequence"
             if layout.paged else f"contiguous, {layout.max_len} positions per sequence")
    print(f"backend {jax.default_backend()} | batch {len(prompts)} | cache {cache} | "
          f"prefill {result['prefill_s'] * 1e3:.1f} ms | {args.tokens} steps in "
          f"{result['decode_s']:.2f} s "
          f"({len(prompts) * args.tokens / result['decode_s']:,.0f} tokens/s)")
    for prompt, text in zip(prompts, result["texts"]):
        print("-" * 60 + f"\n{prompt}{text}")
    check = None
    if args.check:
        check = check_against_full_forward(cfg, params, prompts, args.tokens, page_size)
        print(f"check: greedy with the cache vs full forward each step: logits rel err "
              f"{check['rel_err']:.2e} (rtol {check['rtol']:g}), "
              + ("same tokens" if check["first_divergence"] is None
                 else f"tokens differ from step {check['first_divergence']} (a near tie)")
              + f" -> {'PASSED' if check['passed'] else 'FAILED'}")
    finite = bool(np.isfinite(result["logits"]).all())
    return {"texts": result["texts"], "tokens": result["tokens"], "check": check,
            "ok": finite and (check is None or check["passed"])}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
