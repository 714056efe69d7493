"""Train a byte-level causal language model on `pallas_flash.flash_attention`.

The model is a plain-JAX decoder: pre-RMSNorm blocks with grouped-query attention (RoPE on
queries and keys) and a GELU MLP, optimised with optax (AdamW, warmup then cosine decay,
global-norm clipping). Every attention call goes through
`pallas_flash.flash_attention(..., causal=True)`, so training exercises the forward and both
backward kernels inside `jax.jit` (and `lax.scan` with `--scan`), and evaluation the forward
alone.

Data. By default the model reads `examples/data/shakespeare.txt` (public domain, committed; see
`examples/data/README.md`) one byte per token, so the vocabulary is 256 and the loss in bits per
token is bits per byte (bpb). The last tenth of the text is held out; validation bpb is printed
every `--eval-every` steps and at the end. `--text PATH` trains on any other file instead.
`--data synthetic` swaps in a generated stream (repeated walks of a random Markov chain) that
needs no file at all.

Check. After training, the script replays the first few steps from the same initialisation and
batches with `pallas_flash.reference_attention` and checks that the training losses agree within
a tolerance that suits the compute dtype. It exits non-zero when they do not, or when a loss is
not finite.

Usage (from the repository root):

    python examples/train_lm.py                        # tiny on a CPU, gpu on an accelerator
    python examples/train_lm.py --preset tiny --steps 100
    python examples/train_lm.py --preset gpu --steps 400 --seq 8192 --batch 4
    python examples/train_lm.py --data synthetic       # no text file needed
    python examples/train_lm.py --no-check             # skip the reference comparison
    python examples/train_lm.py --save lm.npz          # keep the weights for generate.py

`tqdm` draws the progress bar when it is installed; otherwise a plain textual bar is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    import pallas_flash
except ImportError:
    # Run from a source checkout without an install: the package sits one directory up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pallas_flash


try:
    from tqdm.auto import tqdm
except ImportError:  # tqdm is optional; _TextBar below stands in for it.
    tqdm = None


DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
VOCAB = 256  # one token per byte


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, optimiser and schedule settings for one run (hashable, so usable as a jit static)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_ratio: int
    seq: int
    batch: int
    steps: int
    lr: float  # peak learning rate
    warmup: int
    weight_decay: float
    clip: float  # global gradient-norm bound
    dtype: str  # compute dtype; parameters and optimiser state are always float32
    remat: bool
    scan: bool  # lax.scan over the layers instead of a Python loop
    seed: int
    eval_every: int
    eval_batches: int
    check_steps: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def validate(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if min(self.steps, self.batch, self.eval_batches, self.check_steps) < 1 or self.seq < 2:
            raise ValueError(
                "steps, batch, eval_batches and check_steps must be positive, and seq >= 2")
        if self.warmup < 0 or self.eval_every < 0:
            raise ValueError("warmup and eval_every must not be negative")


PRESETS = {
    # Small enough for Pallas interpret mode on a 2-core CPU to run in about a minute,
    # compilation included, yet it gets well below the text's unigram entropy (about 4.7 bpb).
    # 4 query heads share 2 KV heads so GQA is exercised.
    "tiny": Config(
        d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_ratio=4, seq=64, batch=8,
        steps=300, lr=3e-3, warmup=20, weight_decay=0.1, clip=1.0, dtype="float32",
        remat=False, scan=False, seed=0, eval_every=100, eval_batches=4, check_steps=3,
    ),
    # Head dim 128 and 4k-byte contexts, where flash attention matters: the naive
    # [batch, heads, seq, seq] float32 scores would take 3.2 GB per layer. bfloat16 compute with
    # float32 master weights (the cast happens inside the loss). 400 steps are about nine passes
    # over the training text; much longer runs begin to overfit a text this small.
    "gpu": Config(
        d_model=768, n_layers=8, n_heads=6, n_kv_heads=2, mlp_ratio=4, seq=4096, batch=8,
        steps=400, lr=2e-3, warmup=40, weight_decay=0.1, clip=1.0, dtype="bfloat16",
        remat=False, scan=False, seed=0, eval_every=100, eval_batches=8, check_steps=3,
    ),
}

# Per-step relative loss tolerance for the reference check. Float32 paths differ only in
# summation order; bfloat16 rounds every activation, and the two attentions round differently.
_CHECK_RTOL = {"float32": 1e-3, "bfloat16": 2e-2}
# Relative error of the attention weights' gradients (wq, wk) at initialisation, flash against
# reference: at initialisation the loss barely depends on attention, these depend on nothing
# else. bfloat16 rounds q, k, v and P in both, differently.
_GRAD_RTOL = {"float32": 1e-3, "bfloat16": 5e-2}


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
# Both sources give int32 token windows of shape [batch, seq + 1] (inputs [:, :-1], targets
# [:, 1:]). Training batches depend only on (seed, step), so the reference replay sees exactly
# the batches the flash run saw; evaluation batches are fixed, so every evaluation is comparable.


class TextData:
    """Random byte windows from the first part of a text; fixed windows from its held-out end."""

    def __init__(self, cfg: Config, text: bytes, val_fraction: float = 0.1):
        self.cfg = cfg
        tokens = np.frombuffer(text, dtype=np.uint8)
        # A contiguous tail, not random windows, so that no validation byte was trained on.
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        for name, part in (("training", self.train), ("validation", self.val)):
            if len(part) < cfg.seq + 1:
                raise ValueError(f"the {name} split has {len(part)} bytes, fewer than seq + 1 = "
                                 f"{cfg.seq + 1}; use a longer text or a shorter --seq")

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return tokens[starts[:, None] + np.arange(self.cfg.seq + 1)].astype(np.int32)

    def batch(self, step: int) -> np.ndarray:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 1, step])
        starts = rng.integers(0, len(self.train) - cfg.seq, size=cfg.batch)
        return self._windows(self.train, starts)

    def eval_batches(self) -> np.ndarray:
        """[eval_batches, batch, seq + 1] windows spread evenly over the validation split."""
        cfg = self.cfg
        n = cfg.eval_batches * cfg.batch
        starts = np.linspace(0, len(self.val) - cfg.seq - 1, n).astype(np.int64)
        return self._windows(self.val, starts).reshape(cfg.eval_batches, cfg.batch, -1)


class SyntheticData:
    """A learnable stream with no file behind it: repeated walks of a fixed Markov chain.

    Every token has `branching` successors with geometrically falling probabilities, so the
    next token is partly predictable from the current one. Each sequence repeats one walk of
    `pattern_len` tokens, so from the second repeat on the next token is predictable by looking
    back one period: attention has something to find. A little uniform noise is mixed in.
    """

    def __init__(self, cfg: Config, pattern_len: int | None = None, noise: float = 0.05,
                 branching: int = 4):
        self.cfg = cfg
        self.pattern_len = pattern_len or max(1, cfg.seq // 4)
        self.noise = noise
        table_rng = np.random.default_rng([cfg.seed, 0])
        self.successors = table_rng.integers(0, VOCAB, size=(VOCAB, branching))
        weights = 0.5 ** np.arange(branching)
        self.probs = weights / weights.sum()

    def _sample(self, rng: np.random.Generator) -> np.ndarray:
        cfg = self.cfg
        period = min(self.pattern_len, cfg.seq + 1)
        walk = np.empty((cfg.batch, period), dtype=np.int32)
        walk[:, 0] = rng.integers(0, VOCAB, size=cfg.batch)
        choice = rng.choice(len(self.probs), size=(cfg.batch, period), p=self.probs)
        for t in range(1, period):
            walk[:, t] = self.successors[walk[:, t - 1], choice[:, t]]
        reps = -(-(cfg.seq + 1) // period)
        tokens = np.tile(walk, (1, reps))[:, : cfg.seq + 1]
        noisy = rng.random(tokens.shape) < self.noise
        tokens = np.where(noisy, rng.integers(0, VOCAB, size=tokens.shape), tokens)
        return tokens.astype(np.int32)

    def batch(self, step: int) -> np.ndarray:
        return self._sample(np.random.default_rng([self.cfg.seed, 1, step]))

    def eval_batches(self) -> np.ndarray:
        # Fresh walks of the same chain, from a seed stream that training never draws from.
        return np.stack([self._sample(np.random.default_rng([self.cfg.seed, 2, i]))
                         for i in range(self.cfg.eval_batches)])


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def init_params(cfg: Config, key: jax.Array) -> dict:
    """Float32 parameters; per-layer weights are stacked on a leading axis (one pytree)."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.mlp_ratio * cfg.d_model
    q_width, kv_width = cfg.n_heads * hd, cfg.n_kv_heads * hd
    # Shrink the residual-branch outputs so the residual stream's scale does not grow with depth.
    out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)

    def normal(k, shape, std):
        return std * jax.random.normal(k, shape, jnp.float32)

    def layer(k):
        kq, kk, kv, ko, ki, km = jax.random.split(k, 6)
        return {
            "attn_norm": jnp.ones((d,), jnp.float32),
            "wq": normal(kq, (d, q_width), d**-0.5),
            "wk": normal(kk, (d, kv_width), d**-0.5),
            "wv": normal(kv, (d, kv_width), d**-0.5),
            "wo": normal(ko, (q_width, d), q_width**-0.5 * out_scale),
            "mlp_norm": jnp.ones((d,), jnp.float32),
            "w_in": normal(ki, (d, f), d**-0.5),
            "w_out": normal(km, (f, d), f**-0.5 * out_scale),
        }

    k_embed, k_layers, k_head = jax.random.split(key, 3)
    return {
        "embed": normal(k_embed, (VOCAB, d), 1.0),
        "layers": jax.vmap(layer)(jax.random.split(k_layers, cfg.n_layers)),
        "final_norm": jnp.ones((d,), jnp.float32),
        # Logits start with std ~0.2 at any width, so the first loss sits near ln(256). Not
        # zero: a zero head would make step 0's loss independent of attention, weakening the
        # reference check.
        "lm_head": normal(k_head, (d, VOCAB), 0.2 * d**-0.5),
    }


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    # The mean of squares is taken in float32: in bfloat16 it loses most of its precision.
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, theta: float = 10000.0, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half layout).

    `positions` [batch, seq] gives each token's position; by default 0 .. seq - 1 in every row
    (training). Sampling passes the positions of the new tokens in each sequence.
    """
    seq, half = x.shape[1], x.shape[-1] // 2
    if positions is None:
        positions = jnp.arange(seq)[None, :]
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def flash_attention(q, k, v):
    return pallas_flash.flash_attention(q, k, v, causal=True, scale=q.shape[-1] ** -0.5)


def reference_attention(q, k, v):
    # The reference computes in float32; cast back so both models see the same dtypes after.
    out = pallas_flash.reference_attention(q, k, v, causal=True, scale=q.shape[-1] ** -0.5)
    return out.astype(q.dtype)


def attention_inputs(cfg: Config, x: jax.Array, p: dict,
                     positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's q [batch, seq, n_heads, head_dim] and k, v [batch, seq, n_kv_heads, head_dim],
    RoPE applied to q and k, from its input x [batch, seq, d_model]."""
    b, s, _ = x.shape
    h = rms_norm(x, p["attn_norm"])
    q = (h @ p["wq"]).reshape(b, s, cfg.n_heads, cfg.head_dim)
    k = (h @ p["wk"]).reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    v = (h @ p["wv"]).reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    return rope(q, positions=positions), rope(k, positions=positions), v


def attention_output(cfg: Config, x: jax.Array, o: jax.Array, p: dict) -> jax.Array:
    """The rest of the layer, given its input x and the attention output o."""
    b, s, _ = x.shape
    x = x + o.reshape(b, s, cfg.n_heads * cfg.head_dim) @ p["wo"]
    h = rms_norm(x, p["mlp_norm"])
    return x + jax.nn.gelu(h @ p["w_in"]) @ p["w_out"]


def block(cfg: Config, attn: AttentionFn, x: jax.Array, p: dict) -> jax.Array:
    # K and V keep n_kv_heads heads: the kernel maps query-head groups onto them itself (GQA),
    # so they are never repeated in memory.
    q, k, v = attention_inputs(cfg, x, p)
    return attention_output(cfg, x, attn(q, k, v), p)


def compute_params(cfg: Config, params: dict) -> dict:
    # Mixed precision: the float32 master weights are cast once per step, so gradients flow
    # back to float32 and the optimiser never updates bfloat16 values.
    return jax.tree.map(lambda a: a.astype(cfg.compute_dtype), params)


def embed(p: dict, tokens: jax.Array) -> jax.Array:
    # A one-hot product rather than a gather: the gather's gradient is a scatter-add in which
    # every token of the batch collides on 256 rows, far slower on a GPU than this small matmul.
    return jax.nn.one_hot(tokens, VOCAB, dtype=p["embed"].dtype) @ p["embed"]


def unembed(p: dict, x: jax.Array) -> jax.Array:
    """Float32 logits [..., 256] from the last layer's output."""
    return (rms_norm(x, p["final_norm"]) @ p["lm_head"]).astype(jnp.float32)


def forward(cfg: Config, attn: AttentionFn, params: dict, tokens: jax.Array) -> jax.Array:
    """Float32 logits [batch, seq, 256] for int tokens [batch, seq]."""
    p = compute_params(cfg, params)
    x = embed(p, tokens)
    layer = functools.partial(block, cfg, attn)
    if cfg.remat:
        # Keep only each layer's input for the backward pass and recompute the rest.
        layer = jax.checkpoint(layer)
    if cfg.scan:
        # Compile time stays flat in depth.
        x, _ = jax.lax.scan(lambda carry, lp: (layer(carry, lp), None), x, p["layers"])
    else:
        # Unrolled, XLA fuses across layer boundaries and does not stack every layer's
        # residuals for the backward pass: a faster step at these depths.
        for i in range(cfg.n_layers):
            x = layer(x, jax.tree.map(lambda a: a[i], p["layers"]))
    return unembed(p, x)


def loss_fn(cfg: Config, attn: AttentionFn, params: dict, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats over tokens [batch, seq + 1]."""
    logits = forward(cfg, attn, params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def bits(nats: float) -> float:
    return nats / math.log(2)


# --------------------------------------------------------------------------------------------
# Optimiser
# --------------------------------------------------------------------------------------------


def make_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to the peak, then cosine decay to a tenth of it at the last step.

    The warmup starts at peak / (warmup + 1), not zero, so the first update is not a no-op:
    update t (from 0) uses peak * (t + 1) / (warmup + 1) until the peak.
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr / (cfg.warmup + 1), peak_value=cfg.lr, warmup_steps=cfg.warmup,
        decay_steps=max(cfg.steps, cfg.warmup + 1), end_value=cfg.lr / 10)


def _decay_mask(params: dict) -> dict:
    # Norm scales are left out of weight decay: pulling them toward zero only fights the norm.
    return jax.tree_util.tree_map_with_path(lambda path, _: not path[-1].key.endswith("norm"),
                                            params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    return optax.chain(
        # Clipping first, so one bad batch early in training cannot blow the moments up.
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(make_schedule(cfg), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                    mask=_decay_mask),
    )


def make_train_step(cfg: Config, attn: AttentionFn, optimizer: optax.GradientTransformation):
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(functools.partial(loss_fn, cfg, attn))(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, optax.tree.norm(grads)

    # Donating the old parameters and moments lets XLA update them in place.
    return jax.jit(train_step, donate_argnums=(0, 1))


def make_evaluator(cfg: Config, attn: AttentionFn, batches: np.ndarray):
    """A function of params giving the mean loss in bits per token over the fixed batches."""
    batches = [jnp.asarray(b) for b in batches]
    eval_loss = jax.jit(functools.partial(loss_fn, cfg, attn))

    def evaluate(params) -> float:
        # Summed on the device so the host waits once, not once per batch.
        return bits(float(sum(eval_loss(params, b) for b in batches)) / len(batches))

    return evaluate


# --------------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------------


class _TextBar:
    """Minimal stand-in for tqdm: one self-overwriting line on stderr."""

    def __init__(self, total: int, desc: str, width: int = 30):
        self.total, self.desc, self.width, self.n, self.postfix = total, desc, width, 0, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        filled = int(self.width * self.n / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.desc} [{bar}] {self.n}/{self.total} {self.postfix}")
        sys.stderr.flush()

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def write(self, s: str) -> None:
        sys.stderr.write("\r" + " " * (self.width + len(self.desc) + 40) + "\r")
        print(s, flush=True)

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    if tqdm is not None:
        return tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True)
    return _TextBar(total, desc)


# Jitted once at module level so the reference replay reuses the compiled initialiser.
_init_params = jax.jit(init_params, static_argnums=0)


def train(cfg: Config, attn: AttentionFn, data, steps: int, desc: str, *, log_every: int,
          evaluate: bool = True, show_progress: bool = True, remat: bool | None = None) -> dict:
    """Run `steps` steps from the seed's initialisation.

    Returns per-step training losses (nats), gradient norms and step times, `val_bpb`, a list
    of (steps done, validation bits per token), evaluated every `cfg.eval_every` steps and after
    the last step (nothing when `evaluate` is false), and the trained `params`.
    """
    # Initialise from cfg itself, not a remat variant, so the params are bit-identical across
    # runs and the compiled initialiser is reused.
    params = _init_params(cfg, jax.random.key(cfg.seed))
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(params)
    schedule = make_schedule(cfg)
    if remat is not None:
        cfg = dataclasses.replace(cfg, remat=remat)
    step_fn = make_train_step(cfg, attn, optimizer)
    validate = make_evaluator(cfg, attn, data.eval_batches()) if evaluate else None

    bar = _progress(steps, desc, show_progress)
    emit = bar.write if bar is not None else print
    losses, grad_norms, step_times, val_bpb = [], [], [], []
    smooth = None  # per-batch losses are noisy; show a trend too
    for i in range(steps):
        tokens = jnp.asarray(data.batch(i))
        start = time.perf_counter()
        params, opt_state, loss, gnorm = step_fn(params, opt_state, tokens)
        # Fetching the loss each step serialises host and device; a step is long next to the
        # dispatch, so the throughput barely notices.
        loss, gnorm = float(loss), float(gnorm)
        step_times.append(time.perf_counter() - start)
        losses.append(loss)
        grad_norms.append(gnorm)
        smooth = loss if smooth is None else 0.9 * smooth + 0.1 * loss
        if bar is not None:
            bar.set_postfix_str(f"{bits(loss):.3f} bits (avg {bits(smooth):.3f})")
            bar.update(1)
        done = i + 1
        if log_every and (done == 1 or done % log_every == 0 or done == steps):
            emit(f"{desc} step {done:5d} | train {bits(loss):.3f} bits (avg {bits(smooth):.3f}) | "
                 f"grad norm {gnorm:.3f} | lr {float(schedule(i)):.2e} | "
                 f"{step_times[-1] * 1e3:.0f} ms")
        if validate is not None and ((cfg.eval_every and done % cfg.eval_every == 0)
                                     or done == steps):
            val_bpb.append((done, validate(params)))
            emit(f"{desc} step {done:5d} | validation {val_bpb[-1][1]:.3f} bits per token")
    if bar is not None:
        bar.close()
    return {"losses": losses, "grad_norms": grad_norms, "step_times": step_times,
            "val_bpb": val_bpb, "params": params}


def tokens_per_second(cfg: Config, step_times: list[float]) -> float:
    """Training throughput over the steady steps (evaluation time excluded)."""
    # The first step compiles; the second can still pay one-time costs such as kernel loading.
    steady = step_times[2:] if len(step_times) > 2 else step_times[1:]
    return cfg.batch * cfg.seq * len(steady) / sum(steady) if steady else float("nan")


# --------------------------------------------------------------------------------------------
# Reference check
# --------------------------------------------------------------------------------------------


def compare_losses(flash: list[float], ref: list[float], rtol: float) -> tuple[list[float], bool]:
    """Per-step relative errors, and whether every one is finite and within `rtol`."""
    rel_errs = [abs(f - r) / max(abs(r), 1e-12) for f, r in zip(flash, ref)]
    # NaN compares false with everything, so test finiteness explicitly; and an empty or
    # truncated comparison must not pass by default.
    passed = len(flash) == len(ref) > 0 and all(math.isfinite(e) and e <= rtol for e in rel_errs)
    return rel_errs, passed


def check_against_reference(cfg: Config, data, flash_losses: list[float], show_progress: bool,
                            rtol: float | None = None) -> dict:
    """Replay the flash run's first steps with reference attention; compare per-step losses."""
    # The reference materialises [batch, heads, seq, seq] scores in every layer; rematerialising
    # per layer keeps one layer's worth alive in the backward pass instead of all of them.
    ref = train(cfg, reference_attention, data, len(flash_losses), "reference", log_every=0,
                evaluate=False, show_progress=show_progress, remat=True)
    if rtol is None:
        rtol = _CHECK_RTOL.get(cfg.dtype, 2e-2)
    rel_errs, passed = compare_losses(flash_losses, ref["losses"], rtol)
    print(f"reference check ({cfg.dtype}, rtol {rtol:g}):")
    for i, (f, r, e) in enumerate(zip(flash_losses, ref["losses"], rel_errs)):
        print(f"  step {i}: flash {f:.6f}  reference {r:.6f}  rel err {e:.2e}")
    grad_errs = attention_grad_errors(cfg, data)
    grad_rtol = _GRAD_RTOL.get(cfg.dtype, 5e-2)
    for name, e in grad_errs.items():
        print(f"  d{name} at initialisation: rel err {e:.2e}")
    passed = passed and all(math.isfinite(e) and e <= grad_rtol for e in grad_errs.values())
    print(f"reference check {'PASSED' if passed else 'FAILED'}")
    return {"ref_losses": ref["losses"], "rel_errs": rel_errs, "rtol": rtol,
            "grad_rel_errs": grad_errs, "grad_rtol": grad_rtol, "passed": passed}


def attention_grad_errors(cfg: Config, data) -> dict[str, float]:
    """Relative Frobenius error of the loss gradient in wq and wk (every layer) at the seed's
    initialisation, on the first batch: flash attention against reference attention."""
    params = _init_params(cfg, jax.random.key(cfg.seed))
    tokens = jnp.asarray(data.batch(0))
    ref_cfg = dataclasses.replace(cfg, remat=True)

    def grads(attn, cfg):
        return jax.jit(jax.grad(lambda p: loss_fn(cfg, attn, p, tokens)))(params)

    flash, ref = grads(flash_attention, cfg), grads(reference_attention, ref_cfg)
    return {name: float(jnp.linalg.norm(flash["layers"][name] - ref["layers"][name])
                        / jnp.linalg.norm(ref["layers"][name])) for name in ("wq", "wk")}


# --------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------
# One .npz of numpy arrays, no pickle: the parameters under their pytree paths ("layers/wq"),
# and the config as JSON text under "config".


def save_checkpoint(path: str | Path, cfg: Config, params: dict) -> Path:
    """Writes the float32 parameters and the config to `path` (.npz); returns the path."""
    flat = {"/".join(k.key for k in keys): np.asarray(leaf)
            for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    path = Path(path)
    with path.open("wb") as f:  # a file object: np.savez would append .npz to a bare name
        np.savez(f, config=np.array(json.dumps(dataclasses.asdict(cfg))), **flat)
    return path


def load_checkpoint(path: str | Path) -> tuple[Config, dict]:
    """(config, params) from a file written by `save_checkpoint`."""
    with np.load(path, allow_pickle=False) as data:
        cfg = Config(**json.loads(str(data["config"])))
        params: dict = {}
        for name in data.files:
            if name == "config":
                continue
            *parents, leaf = name.split("/")
            node = params
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = jnp.asarray(data[name])
    cfg.validate()
    return cfg, params


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="model and run size; default: tiny on CPU, gpu on an accelerator")
    parser.add_argument("--data", choices=["text", "synthetic"], default="text",
                        help="train on bytes of --text (default) or on a generated stream")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                        help="text file for --data text (default: the committed Shakespeare)")
    parser.add_argument("--steps", type=int, help="training steps")
    parser.add_argument("--seq", type=int, help="sequence length in tokens (bytes)")
    parser.add_argument("--batch", type=int, help="sequences per step")
    parser.add_argument("--d-model", type=int, help="model width")
    parser.add_argument("--layers", type=int, help="number of transformer blocks")
    parser.add_argument("--heads", type=int, help="query heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (fewer than --heads: GQA)")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--warmup", type=int, help="linear warmup steps")
    parser.add_argument("--weight-decay", type=float, help="AdamW decoupled weight decay")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None,
                        help="recompute each layer in the backward pass to save memory")
    parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                        help="lax.scan over the layers (compile time flat in depth) instead of "
                             "unrolling them (a faster step)")
    parser.add_argument("--seed", type=int, help="seed for parameters and data")
    parser.add_argument("--eval-every", type=int,
                        help="steps between validation passes (0: only after the last step)")
    parser.add_argument("--eval-batches", type=int, help="batches in each validation pass")
    parser.add_argument("--check-steps", type=int,
                        help="steps replayed with reference attention for the check")
    parser.add_argument("--check-rtol", type=float,
                        help="per-step relative loss tolerance (default: 1e-3 float32, "
                             "2e-2 bfloat16)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the comparison against reference_attention")
    parser.add_argument("--log-every", type=int, help="print a loss line every N steps (0: never)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--save", type=Path, metavar="PATH",
                        help="write the trained parameters and config to PATH (.npz), for "
                             "examples/generate.py --checkpoint")
    return parser.parse_args(argv)


def build_config(args) -> Config:
    preset = args.preset or ("tiny" if jax.default_backend() == "cpu" else "gpu")
    overrides = {
        "steps": args.steps, "seq": args.seq, "batch": args.batch, "d_model": args.d_model,
        "n_layers": args.layers, "n_heads": args.heads, "n_kv_heads": args.kv_heads,
        "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
        "dtype": args.dtype, "remat": args.remat, "scan": args.scan, "seed": args.seed,
        "eval_every": args.eval_every, "eval_batches": args.eval_batches,
        "check_steps": args.check_steps,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    cfg = dataclasses.replace(PRESETS[preset], **given)
    cfg.validate()
    return cfg


def build_data(args, cfg: Config):
    if args.data == "synthetic":
        return SyntheticData(cfg)
    return TextData(cfg, args.text.read_bytes())


def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate, optionally check against the reference, and return what happened.

    Returns a dict with `losses` and `grad_norms` (per step; losses in nats), `val_bpb`
    ((steps done, bits per token) pairs) and `final_val_bpb`, `tokens_per_s`, `check` (None
    with --no-check, otherwise the reference losses, relative errors and `passed`),
    `check_passed`, `ok` (every loss finite and the check did not fail), `config`, `data` and
    `checkpoint` (the --save path, or None).
    """
    args = parse_args(argv)
    cfg = build_config(args)
    data = build_data(args, cfg)
    log_every = args.log_every if args.log_every is not None else max(1, cfg.steps // 10)
    show_progress = not args.no_progress

    n_params = sum(x.size for x in jax.tree.leaves(
        jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))))
    source = (f"{args.text.name}: {len(data.train):,} training / {len(data.val):,} validation "
              f"bytes" if args.data == "text" else "synthetic Markov-chain tokens")
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}) | "
          f"{n_params / 1e6:.2f}M params | d_model {cfg.d_model}, {cfg.n_layers} layers, "
          f"{cfg.n_heads} q / {cfg.n_kv_heads} kv heads of {cfg.head_dim} | seq {cfg.seq}, "
          f"batch {cfg.batch}, {cfg.steps} steps, {cfg.dtype}")
    print(f"data: {source} | a uniform guess costs 8 bits per token")

    start = time.perf_counter()
    run = train(cfg, flash_attention, data, cfg.steps, "flash", log_every=log_every,
                show_progress=show_progress)
    seconds = time.perf_counter() - start
    losses = run["losses"]
    final_val = run["val_bpb"][-1][1]
    tokens_per_s = tokens_per_second(cfg, run["step_times"])
    unit = "bpb" if args.data == "text" else "bits/token"
    print(f"train {bits(losses[0]):.3f} -> {bits(losses[-1]):.3f} {unit} | "
          f"validation {final_val:.3f} {unit} | {tokens_per_s:,.0f} tokens/s | "
          f"{seconds:.1f} s in all")

    checkpoint = None
    if args.save is not None:
        checkpoint = str(save_checkpoint(args.save, cfg, run["params"]))
        print(f"checkpoint: {checkpoint}")

    check = None
    if not args.no_check:
        # Reuse the flash run's own first steps: same seed, same batches, so only the reference
        # side has to be recomputed.
        check = check_against_reference(cfg, data, losses[: cfg.check_steps], show_progress,
                                        rtol=args.check_rtol)

    finite = all(math.isfinite(x) for x in losses) and math.isfinite(final_val)
    if not finite:
        print("non-finite loss encountered")
    check_passed = None if check is None else check["passed"]
    return {
        "losses": losses,
        "grad_norms": run["grad_norms"],
        "val_bpb": run["val_bpb"],
        "final_val_bpb": final_val,
        "tokens_per_s": tokens_per_s,
        "train_seconds": seconds,
        "check": check,
        "check_passed": check_passed,
        "ok": finite and check_passed is not False,
        "config": dataclasses.asdict(cfg),
        "data": args.data,
        "checkpoint": checkpoint,
    }


def cli(argv: list[str] | None = None) -> int:
    """Process exit status: 0 when training stayed finite and the reference check passed."""
    return 0 if main(argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(cli())
