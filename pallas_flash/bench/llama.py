"""The model of the training-step benchmark: a Llama-style decoder in plain JAX.

Pre-RMSNorm blocks of grouped-query attention (rotary embeddings on q and k) and a SwiGLU MLP,
an embedding table (tied to the output head or not) and a float32 cross-entropy loss. The
attention is a parameter, ``attn(q, k, v) -> o`` on ``[batch, seq, heads, head_dim]`` arrays
(k and v with ``kv_heads`` heads), so one model serves every implementation compared.
Parameters and activations are in the compute dtype; Adam keeps its moments in float32.

The layers are unrolled (a Python loop, not ``lax.scan``): XLA then fuses across layer
boundaries and keeps no stacked copy of every layer's residuals, which is how a training step
at these depths is usually compiled.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_flash.bench.cases import attention_flops

__all__ = ["ModelConfig", "PRESETS", "init_params", "init_adam", "loss_fn", "make_train_step",
           "step_flops", "tree_bytes"]

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. Frozen and hashable: a static argument of the jitted step."""

    d_model: int
    n_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab: int
    tied: bool = False
    dtype: str = "bfloat16"
    rope_theta: float = 500_000.0

    def __post_init__(self):
        for name in ("d_model", "n_layers", "q_heads", "kv_heads", "head_dim", "mlp_dim",
                     "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} is not a multiple of kv_heads "
                             f"{self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


PRESETS = {
    # Llama-3-8B's layer (d 4096, 32 q / 8 kv heads of 128, SwiGLU 14336) with 4 layers and a
    # 32k vocabulary, so that the step, its Adam state and 32k-token activations fit one H200.
    "llama8b-4l": ModelConfig(d_model=4096, n_layers=4, q_heads=32, kv_heads=8, head_dim=128,
                              mlp_dim=14336, vocab=32768),
    # For tests on a CPU in interpret mode: small enough to compile and run in seconds; float32
    # so that two attention implementations give the same loss to float32 rounding.
    "tiny": ModelConfig(d_model=64, n_layers=2, q_heads=4, kv_heads=2, head_dim=16, mlp_dim=128,
                        vocab=256, dtype="float32"),
}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Parameters in the compute dtype. Matrices are drawn with std 1/sqrt(fan_in), so every
    activation has unit scale and the first loss depends on what attention returns."""
    dt = cfg.compute_dtype
    q_width, kv_width = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def dense(k, fan_in, fan_out):
        return (jax.random.normal(k, (fan_in, fan_out), jnp.float32) * fan_in ** -0.5).astype(dt)

    def layer(k):
        ks = jax.random.split(k, 7)
        return {"attn_norm": jnp.ones((cfg.d_model,), dt),
                "wq": dense(ks[0], cfg.d_model, q_width),
                "wk": dense(ks[1], cfg.d_model, kv_width),
                "wv": dense(ks[2], cfg.d_model, kv_width),
                "wo": dense(ks[3], q_width, cfg.d_model),
                "mlp_norm": jnp.ones((cfg.d_model,), dt),
                "w_gate": dense(ks[4], cfg.d_model, cfg.mlp_dim),
                "w_up": dense(ks[5], cfg.d_model, cfg.mlp_dim),
                "w_down": dense(ks[6], cfg.mlp_dim, cfg.d_model)}

    k_embed, k_head, *k_layers = jax.random.split(key, 2 + cfg.n_layers)
    params = {"embed": jax.random.normal(k_embed, (cfg.vocab, cfg.d_model), jnp.float32)
              .astype(dt),
              "layers": [layer(k) for k in k_layers],
              "final_norm": jnp.ones((cfg.d_model,), dt)}
    if not cfg.tied:
        params["head"] = dense(k_head, cfg.d_model, cfg.vocab)
    return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-5) -> jax.Array:
    # Mean of squares in float32: a bf16 sum over 4096 features loses most of its bits.
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * inv).astype(x.dtype) * weight


def rotary_tables(seq: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [seq, 1, head_dim // 2] of positions 0 .. seq - 1, float32."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None, None] * inv_freq
    return jnp.cos(angle), jnp.sin(angle)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the (first half, second half) feature pairs of x [batch, seq, heads, dim]."""
    lo, hi = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], -1).astype(x.dtype)


def decoder_layer(cfg: ModelConfig, attn: Attention, rotary, x: jax.Array, p: dict):
    b, s, _ = x.shape
    h = rms_norm(x, p["attn_norm"])
    q = (h @ p["wq"]).reshape(b, s, cfg.q_heads, cfg.head_dim)
    k = (h @ p["wk"]).reshape(b, s, cfg.kv_heads, cfg.head_dim)
    v = (h @ p["wv"]).reshape(b, s, cfg.kv_heads, cfg.head_dim)
    # K and V keep kv_heads heads: every implementation compared maps the query groups itself.
    o = attn(apply_rotary(q, *rotary), apply_rotary(k, *rotary), v)
    x = x + o.reshape(b, s, cfg.q_heads * cfg.head_dim) @ p["wo"]
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def loss_fn(cfg: ModelConfig, attn: Attention, params: dict, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32 nats) of int tokens [batch, seq + 1]."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    rotary = rotary_tables(inputs.shape[1], cfg.head_dim, cfg.rope_theta)
    x = params["embed"][inputs]
    for p in params["layers"]:
        x = decoder_layer(cfg, attn, rotary, x, p)
    x = rms_norm(x, params["final_norm"])
    head = params["embed"].T if cfg.tied else params["head"]
    # Logits accumulate and stay in float32 for the softmax: the loss is float32 throughout.
    logits = jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def init_adam(params: dict) -> dict:
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
    return {"count": jnp.zeros((), jnp.int32), "mu": jax.tree.map(zeros, params),
            "nu": jax.tree.map(zeros, params)}


def adam_update(params, grads, state, lr: float, b1=0.9, b2=0.95, eps=1e-8):
    """Adam with float32 moments and bias correction; the update is computed in float32 and
    rounded into the parameters' dtype once."""
    count = state["count"] + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32), state["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)),
                      state["nu"], grads)
    step = lr * jnp.sqrt(1 - b2 ** count.astype(jnp.float32)) / (1 - b1 ** count)

    def apply(p, m, v):
        return (p.astype(jnp.float32) - step * m / (jnp.sqrt(v) + eps)).astype(p.dtype)

    return jax.tree.map(apply, params, mu, nu), {"count": count, "mu": mu, "nu": nu}


def make_train_step(cfg: ModelConfig, attn: Attention, lr: float = 1e-4):
    """jitted ``step(params, opt_state, tokens) -> (params, opt_state, loss)``, the loss of the
    parameters it was given. The parameters and Adam state are donated: updated in place."""

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(functools.partial(loss_fn, cfg, attn))(params, tokens)
        params, opt_state = adam_update(params, grads, opt_state, lr)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def step_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one training step: 6 x tokens x matmul parameters (forward 2, backward 4;
    the embedding gather is free, the output head is not) plus causal attention's fwd+bwd in
    the FlashAttention convention (:func:`~pallas_flash.bench.cases.attention_flops`)."""
    q_width, kv_width = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = cfg.d_model * (2 * q_width + 2 * kv_width + 3 * cfg.mlp_dim)
    matmul_params = cfg.n_layers * per_layer + cfg.d_model * cfg.vocab
    attention = cfg.n_layers * attention_flops(batch, seq, seq, cfg.q_heads, cfg.head_dim,
                                               causal=True, pass_="fwdbwd")
    return 6.0 * batch * seq * matmul_params + attention


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
