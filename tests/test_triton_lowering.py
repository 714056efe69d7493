"""The Triton kernels lower for sm_90 on any machine: the tiles the dispatch picks over head dims,
dtypes and options, explicit tiles, the guarded path's predicated launches, and decoding.

Interpret mode runs the kernels' math but never builds their Triton IR, so it cannot see what
only that lowering rejects, such as an array whose size is not a power of two (a compiled run
then fails before any kernel starts). Pallas's Triton lowering asks the device for its compute
capability; here an abstract H200 (`jax.sharding.AbstractDevice` on an abstract mesh) answers,
so the program lowers for the cuda platform without a GPU, and such a tile fails on the CPU. What
lowering cannot see either, an edge block read without its mask, still needs the compiled suite.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, ON_GPU
from helpers import lower_for_sm90
from pallas_flash import FlashConfig, KernelConfig, attention
from pallas_flash.triton import common

pytestmark = pytest.mark.skipif(ON_GPU and not IS_HOPPER,
                                reason="the abstract H200 stands in for a CPU; other GPUs lower "
                                       "for themselves in the compiled suite")

TRITON_TARGET = "__gpu$xla.gpu.triton"
FWD, DKDV, DQ = "pallas_flash_fwd", "pallas_flash_bwd_dkdv", "pallas_flash_bwd_dq"
DECODE, COMBINE = "pallas_flash_decode", "pallas_flash_decode_combine"
TRAINING = [FWD, DKDV, DQ]


def triton_kernels(fn, *args) -> list[str]:
    """The names of the Triton kernels in fn's program lowered for sm_90, in program order."""
    return [re.search(r'name = \\?"([^"\\]+)', line).group(1)
            for line in lower_for_sm90(fn, *args).splitlines()
            if f"@{TRITON_TARGET}(" in line]


def shape(*dims, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(dims, dtype)


def training_step(seq_q, seq_kv, q_heads, kv_heads, head_dim, dtype, head_dim_v=None, *,
                  backend="triton", batch=1, with_lse=False, **options):
    """(step, its argument shapes): flash_attention's forward and its vjp on a cotangent (and an
    lse cotangent with `with_lse`), as a jitted training step stages them. Array options
    (segment ids, lengths, sinks) are arguments of the step."""
    d_v = head_dim if head_dim_v is None else head_dim_v
    arrays = {name: options.pop(name) for name in list(options)
              if isinstance(options[name], jax.ShapeDtypeStruct)}
    names = sorted(arrays)

    def step(q, k, v, do, dlse, *values):
        kw = dict(zip(names, values))

        def attend(q, k, v):
            return pf.flash_attention(q, k, v, backend=backend, interpret=False,
                                      return_lse=with_lse, **options, **kw)
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp((do, dlse) if with_lse else do)

    args = (shape(batch, seq_q, q_heads, head_dim, dtype=dtype),
            shape(batch, seq_kv, kv_heads, head_dim, dtype=dtype),
            shape(batch, seq_kv, kv_heads, d_v, dtype=dtype),
            shape(batch, seq_q, q_heads, d_v, dtype=dtype),
            shape(batch, q_heads, seq_q, dtype=jnp.float32) if with_lse else None,
            *(arrays[n] for n in names))
    return step, args


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", [1, 16, 24, 32, 48, 64, 72, 80, 96, 112, 128, 160, 192, 200,
                                      256])
def test_training_step_lowers_at_every_head_dim(head_dim, dtype):
    """Default tiles, causal, 1000 tokens (no tile multiple): head dims that are powers of two
    and ones padded to the next (1, 24, 72, 200), in each dtype the Triton kernels take."""
    step, args = training_step(1000, 1000, 4, 2, head_dim, dtype, causal=True)
    assert triton_kernels(step, *args) == TRAINING


SEGMENTS = shape(2, 1000, dtype=jnp.int32)
LENGTHS = shape(2, dtype=jnp.int32)


@pytest.mark.parametrize("dims,options", [
    ((1000, 1000, 4, 4, 128), dict(window=(100, 50))),
    ((1000, 1000, 4, 4, 128), dict(softcap=30.0, causal=True)),
    ((1000, 1000, 4, 2, 128), dict(sinks=shape(4, dtype=jnp.float32), causal=True)),
    ((1000, 1000, 4, 2, 64), dict(q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS)),
    ((1000, 1000, 4, 2, 64), dict(q_lengths=LENGTHS, kv_lengths=LENGTHS, causal=True)),
    ((300, 1000, 8, 1, 128), dict(causal=True, causal_alignment="bottom_right")),
    ((1000, 300, 8, 8, 64), dict(causal=True)),
    ((1, 1, 4, 4, 64), dict(causal=True)),
    ((17, 33, 4, 4, 64), {}),
    ((1000, 1000, 8, 2, 192, 128), dict(causal=True)),
    ((1000, 1000, 4, 4, 64, 32), {}),
    ((1000, 1000, 4, 4, 128), dict(causal=True, with_lse=True)),
], ids=["window", "softcap", "sinks", "segments", "lengths", "cross-bottom-right",
        "cross-short-keys", "one-token", "odd-lengths", "mla-192-128", "mla-64-32", "lse"])
def test_training_step_lowers_with_options(dims, options):
    """The options' masks, operands and outputs, on sizes that are no tile multiple, batch 2."""
    b = 2 if any(isinstance(v, jax.ShapeDtypeStruct) and v.shape[0] == 2
                 for v in options.values()) else 1
    step, args = training_step(*dims[:5], jnp.bfloat16, *dims[5:], batch=b, **options)
    assert triton_kernels(step, *args) == TRAINING


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_q,block_kv,num_warps", [
    (16, 16, 1), (16, 128, 4), (32, 64, 4), (64, 32, 8), (128, 32, 8)])
def test_training_step_lowers_with_explicit_tiles(head_dim, block_q, block_kv, num_warps):
    tile = KernelConfig(block_q=block_q, block_kv=block_kv, num_warps=num_warps, num_stages=2)
    config = FlashConfig(fwd=tile, bwd_dkdv=tile, bwd_dq=tile)
    step, args = training_step(1000, 1000, 4, 4, head_dim, jnp.bfloat16, causal=True,
                               config=config)
    assert triton_kernels(step, *args) == TRAINING


def test_a_tile_that_is_no_power_of_two_fails_here(monkeypatch):
    """The check this file exists for: a tile the Triton lowering cannot build fails on the
    CPU, as it would on the GPU (interpret mode runs it)."""
    monkeypatch.setattr(common, "fit_block", lambda block, seq: 48)
    step, args = training_step(1000, 1000, 4, 4, 64, jnp.bfloat16, causal=True)
    with pytest.raises(ValueError, match="power of 2"):
        triton_kernels(step, *args)


@pytest.mark.parametrize("dims,options", [
    ((1000, 1000, 4, 4, 128), dict(causal=True)),
    ((1000, 1000, 4, 2, 64), dict(q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS)),
    ((1000, 1000, 4, 4, 256), {}),
    ((1000, 1000, 8, 2, 192, 128), dict(causal=True)),
], ids=["fused-causal", "segments", "d256", "mla"])
def test_guarded_step_lowers_its_predicated_fallback(monkeypatch, dims, options):
    """backend="auto" on sm_90: the Triton kernels launched behind the Mosaic ones, predicated
    on the finiteness flag, with their outputs aliasing the Mosaic results."""
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(attention, "_capability", lambda: "9.0")
    b = 2 if options else 1
    step, args = training_step(*dims[:5], jnp.bfloat16, *dims[5:], backend="auto", batch=b,
                               **options)
    assert triton_kernels(step, *args) == TRAINING


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("batch,q_len,q_heads,kv_heads,head_dim,page_size,options", [
    (1, 1, 32, 8, 128, None, {}),
    (3, 1, 8, 8, 64, None, {}),
    (2, 3, 8, 1, 80, None, dict(softcap=30.0)),
    (2, 16, 8, 2, 128, None, dict(window=(100, 0))),
    (2, 1, 8, 2, 256, 16, {}),
    (2, 4, 32, 8, 128, 64, dict(sinks=shape(32, dtype=jnp.float32))),
    (1, 1, 64, 8, 128, 64, dict(num_splits=1)),
], ids=["32:8", "mha", "mqa-q3-softcap", "q16-window", "paged16-d256", "paged64-q4-sinks",
        "one-split"])
def test_decode_lowers(dtype, batch, q_len, q_heads, kv_heads, head_dim, page_size, options):
    """decode_attention's Triton kernels: the split kernel on a contiguous and a paged cache of
    1000 keys (no page or block multiple), and the combine wherever there are splits."""
    options = dict(options)
    sinks = options.pop("sinks", None)
    if page_size is None:
        cache = shape(batch, 1000, kv_heads, head_dim, dtype=dtype)
        table = None
    else:
        pages = -(-1000 // page_size)
        cache = shape(batch * pages, page_size, kv_heads, head_dim, dtype=dtype)
        table = shape(batch, pages, dtype=jnp.int32)

    def call(q, cache, lengths, table, sinks):
        return pf.decode_attention(q, cache, cache, kv_lengths=lengths, block_table=table,
                                   sinks=sinks, backend="triton", interpret=False, **options)

    kernels = triton_kernels(call, shape(batch, q_len, q_heads, head_dim, dtype=dtype), cache,
                             shape(batch, dtype=jnp.int32), table, sinks)
    assert kernels == ([DECODE] if options.get("num_splits") == 1 else [DECODE, COMBINE])


@pytest.mark.parametrize("q_len,q_heads,kv_heads,head_dim,num_splits", [
    (1, 32, 8, 128, 16), (4, 64, 8, 128, 16), (3, 12, 2, 80, 21), (2, 64, 1, 256, 7),
    (5, 4, 4, 32, 3),
], ids=["gqa4", "gqa8-q4", "gqa6-d80", "mqa-d256", "mha"])
def test_d_major_combine_lowers(q_len, q_heads, kv_heads, head_dim, num_splits):
    """The combine of the Mosaic keys-as-M kernel's d-major partials [..., head_dim, n], which
    only an sm_90 run reaches through decode_attention."""
    from pallas_flash.mosaic.decode import keys_n
    from pallas_flash.triton import decode as triton_decode
    from test_decode import combine_plan
    plan = combine_plan(2, q_len, q_heads, kv_heads, head_dim, num_splits, interpret=False)
    n = keys_n(plan.rows)

    def call(o, lse):
        return triton_decode.combine(plan, o, lse, jnp.bfloat16, d_major=True)

    kernels = triton_kernels(call, shape(2, kv_heads, num_splits, head_dim, n, dtype=jnp.float32),
                             shape(2, kv_heads, num_splits, n, dtype=jnp.float32))
    assert kernels == [COMBINE]
