"""The one-kernel Mosaic backward (pallas_flash/mosaic/fused_backward.py) beyond the matrix.

test_features.py compares its gradients with the reference (and, compiled, checks that a second
call gives the same bits); test_mosaic_schedule.py covers its launch order. Here: where it runs
and where the two-kernel backward takes over, its shared memory, its sm_90 lowering (the
semaphores and TMA reductions the interpreter does not run), its memory, and jax.vmap.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, ON_GPU
from helpers import (TOLERANCE, all_eqns, assert_close, backward_args, kernel_names,
                     make_spec, random_inputs)
from pallas_flash.mosaic import backward as mosaic
from pallas_flash.mosaic import fused_backward as fused
from pallas_flash.mosaic import schedule
from pallas_flash.mosaic.config import MosaicBackwardConfig, default_backward_config
from pallas_flash.stats import RowStats
from pallas_flash.triton import forward as triton_forward

FUSED = MosaicBackwardConfig(dkdv_block_q=64, fused=True)
needs_hopper = pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")

@pytest.mark.parametrize("d,dtype,options,served", [
    (128, jnp.bfloat16, {}, True),
    (64, jnp.bfloat16, {}, True),
    (128, jnp.float16, {}, True),
    (96, jnp.bfloat16, {}, True),
    (48, jnp.float16, {}, True),
    (144, jnp.bfloat16, {}, False),
    (256, jnp.bfloat16, {}, False),
    (128, jnp.bfloat16, dict(has_segments=True), False),
])
def test_runs_where_it_serves_and_falls_back_elsewhere(d, dtype, options, served):
    q, k, v, _, stats, do, _ = backward_args(1, 256, 256, 2, 1, d, dtype)
    spec = make_spec(256, 256, d, dtype, causal=True, interpret=False, **options)
    assert mosaic.uses_fused(spec, q, k, FUSED) is served
    assert not mosaic.uses_fused(spec, q, k, MosaicBackwardConfig(dkdv_block_q=64))
    args = (q, k, v, q, stats, do, stats.m)
    if spec.has_segments:
        ids = jnp.zeros((1, 256), jnp.int32)
        args = args + (ids, ids)
    cfg = FUSED if d <= 128 else dataclasses.replace(default_backward_config(d), fused=True)
    names = kernel_names(lambda *a: mosaic.backward(spec, *a, config=cfg), *args)
    expected = ({fused.FUSED_KERNEL_NAME} if served
                else {mosaic.DKDV_KERNEL_NAME, mosaic.DQ_KERNEL_NAME})
    assert names == expected, names


def test_shared_memory_is_checked():
    q, k, v, *_ = backward_args(1, 256, 256, 2, 1, 128, jnp.bfloat16)
    spec = make_spec(256, 256, 128, jnp.bfloat16, causal=True, interpret=False)
    cfg = MosaicBackwardConfig(dkdv_block_q=64, fused_stages=3, fused=True, fused_dq_slots=2)
    assert "fused kernel" in mosaic.unsupported_reason(spec, q, k, v, cfg)
    assert mosaic.unsupported_reason(spec, q, k, v, FUSED) is None
    # A second dQ slot does not fit at head_dim 128 beside the two dS^T buffers.
    two = dataclasses.replace(FUSED, fused_dq_slots=2)
    assert "fused kernel" in mosaic.unsupported_reason(spec, q, k, v, two)


def test_dq_columns_tile_the_head_dim():
    """Where the compute warpgroups share the dQ product by columns (112 and 128), their
    slices are whole 16s (a wgmma step, and the tiling layout inference accepts) that cover
    the head_dim once, in order; everywhere else they take turns."""
    split = {d: fused.dq_columns(d) for d in fused.HEAD_DIMS}
    assert {d for d, cols in split.items() if cols is not None} == {112, 128}
    for d, cols in split.items():
        if cols is not None:
            (first0, n0), (first1, n1) = cols
            assert (first0, first1, n0 + n1) == (0, n0, d), d
            assert n0 % 16 == 0 and n1 % 16 == 0, d


@pytest.mark.parametrize("b,d,causal,options,dtype", [
    (2, 128, True, {}, jnp.bfloat16), (2, 128, False, dict(window=(100, 50), softcap=30.0),
                                       jnp.bfloat16),
    (2, 64, True, {}, jnp.bfloat16), (2, 64, False, dict(window=(100, 50), softcap=30.0),
                                      jnp.bfloat16),
    (1, 128, True, {}, jnp.bfloat16),
    (2, 128, True, {}, jnp.float16), (2, 64, False, dict(window=(100, 50), softcap=30.0),
                                      jnp.float16)],
    ids=["causal", "window-softcap", "causal-d64", "window-softcap-d64", "causal-b1-chunk",
         "causal-f16", "window-softcap-d64-f16"])
def test_lowers_for_sm90(b, d, causal, options, dtype):
    """The compiled kernel, semaphores and the writer's TMA reduce-add and early slot release
    included (the interpreter runs none of them), lowers for sm_90; at batch 1 with two heads
    interleaved (`schedule.fused_head_chunk`)."""
    seq = 1001
    q, k, v, _, stats, do, _ = backward_args(b, seq, seq, 4, 2, d, dtype)
    spec = make_spec(seq, seq, d, dtype, causal=causal, interpret=False, **options)
    assert mosaic.uses_fused(spec, q, k, FUSED)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a, config=FUSED))
    text = fn.trace(q, k, v, q, stats, do, stats.m).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("d,causal,options,dtype,fields", [
    (128, True, {}, jnp.bfloat16, {}),
    (64, False, dict(window=(100, 50), softcap=30.0), jnp.float16, dict(fused_ctas=3)),
    (128, True, {}, jnp.bfloat16, dict(fused_launches=2, fused_handout="reversed")),
], ids=["causal", "window-softcap-d64-f16-3ctas", "causal-split-reversed"])
def test_persistent_lowers_for_sm90(d, causal, options, dtype, fields):
    """The persistent grid (items looped per CTA, the K / V buffers handed back between them,
    the plan read from global memory) lowers for sm_90, split over launches too."""
    seq = 1001
    q, k, v, _, stats, do, _ = backward_args(2, seq, seq, 4, 2, d, dtype)
    spec = make_spec(seq, seq, d, dtype, causal=causal, interpret=False, **options)
    cfg = dataclasses.replace(FUSED, fused_persistent=True, **fields)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a, config=cfg))
    text = fn.trace(q, k, v, q, stats, do, stats.m).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _largest_value(jaxpr) -> int:
    """Elements of the largest array any equation of `jaxpr` (or of the jaxprs inside it, the
    kernel bodies included) produces."""
    return max((int(np.prod(getattr(var.aval, "shape", ()))) for eqn in all_eqns(jaxpr)
                for var in eqn.outvars), default=0)


def test_materializes_nothing_quadratic():
    """The fused backward's extra buffers (the float32 dQ sum, the semaphores) are linear in the
    sequence: nothing it computes has seq_q x seq_kv elements."""
    seq = 2048
    args = backward_args(1, seq, seq, 2, 1, 128, jnp.bfloat16)
    spec = make_spec(seq, seq, 128, jnp.bfloat16, causal=True, interpret=False)
    jaxpr = jax.make_jaxpr(lambda *a: mosaic.backward(spec, *a, config=FUSED))(*args).jaxpr
    largest = _largest_value(jaxpr)
    assert 0 < largest < seq * seq // 4, largest
    # The check can fail: the reference's backward holds seq x seq probabilities.
    ref = jax.make_jaxpr(lambda q, k, v: jax.vjp(
        lambda q, k, v: pf.reference_attention(q, k, v, causal=True), q, k, v)[1](q))(
        *args[:3]).jaxpr
    assert _largest_value(ref) >= seq * seq


@needs_hopper
def test_vmap_folds_into_the_batch():
    """jax.vmap (the guarded "auto" path vmaps the kernel it picks) becomes a larger batch of
    one launch: the semaphores are indexed by batch, so instances must not share them. Each
    vmapped example's gradients equal those of the example alone, bit for bit."""
    n, sq, skv, hq, hkv, d, dtype = 2, 128, 192, 2, 1, 128, jnp.bfloat16
    q, k, v, do = random_inputs(jax.random.PRNGKey(63), n, sq, skv, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(64), (n, hq, sq), jnp.float32)
    spec = make_spec(sq, skv, d, dtype, causal=True)
    out, stats = triton_forward.forward(spec, q, k, v)

    def one(q, k, v, out, m, r, do, dlse):  # a batch of one example
        return mosaic.backward(spec, q, k, v, out, RowStats(m, r), do, dlse, config=FUSED)

    args = [x[:, None] for x in (q, k, v, out, stats.m, stats.r, do, dlse)]
    vmapped = jax.jit(jax.vmap(one))
    got = vmapped(*args)
    for i in range(n):
        alone = jax.jit(one)(*(x[i] for x in args))
        for g, a in zip(got, alone):
            np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(a))
    # One launch, its batch the vmapped axis times the batch.
    launches = [eqn.invars[0].aval.shape
                for eqn in all_eqns(jax.make_jaxpr(jax.vmap(one))(*args).jaxpr)
                if eqn.primitive.name in ("pallas_call", "mpmd_map")]
    assert launches == [(n, sq, hq, d)], launches


# ---- the fused backward split over launches (schedule.fused_launches) --------------------------

def _split_case(seed, b, seq, hq, hkv, d, dtype, causal=True):
    q, k, v, do = random_inputs(jax.random.PRNGKey(seed), b, seq, seq, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(seed + 1), (b, hq, seq), jnp.float32)
    spec = make_spec(seq, seq, d, dtype, causal=causal)
    out, stats = triton_forward.forward(spec, q, k, v)
    return spec, (q, k, v, out, stats, do, dlse)


def _launches_of(fn, *args):
    return sum(1 for eqn in all_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
               if eqn.primitive.name in ("pallas_call", "mpmd_map"))


@needs_hopper
@pytest.mark.parametrize("launches,hkv,dtype", [
    (2, 2, jnp.bfloat16),
    pytest.param(4, 4, jnp.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason=(
        "four launches of the Mosaic interpreter outlast the CPU suite's budget; two run here"))),
], ids=["2-bf16", "4-bf16"])
def test_split_launches_give_the_same_bits(launches, hkv, dtype):
    """Each chain of ordered dQ adds belongs to one (batch, q head), and a launch holds whole
    chains: the gradients of a split backward are those of one launch, bit for bit. A launch
    that read or wrote another launch's heads (a wrong head offset) would break this."""
    spec, args = _split_case(71, 1, 256, 2 * hkv, hkv, 64, dtype)
    one = jax.jit(lambda *a: mosaic.backward(spec, *a, config=FUSED))(*args)
    split_cfg = dataclasses.replace(FUSED, fused_launches=launches)
    fn = lambda *a: mosaic.backward(spec, *a, config=split_cfg)
    assert _launches_of(fn, *args) == launches
    split = jax.jit(fn)(*args)
    for name, a, b in zip(("dq", "dk", "dv"), one, split):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


def test_split_holds_one_launch_of_float32():
    """The point of the split: no kernel launch returns a float32 array larger than its share
    of dQ (the one-launch kernel returns the whole float32 sum, so the check can fail). D's
    float32 products are not counted: XLA fuses them into D's reduction."""
    seq, hq, hkv, d = 2048, 8, 4, 128
    args = backward_args(1, seq, seq, hq, hkv, d, jnp.bfloat16)
    spec = make_spec(seq, seq, d, jnp.bfloat16, causal=True, interpret=False)
    q_size = seq * hq * d

    def largest_f32(cfg):
        jaxpr = jax.make_jaxpr(lambda *a: mosaic.backward(spec, *a, config=cfg))(*args).jaxpr
        sizes = [int(np.prod(v.aval.shape)) for eqn in all_eqns(jaxpr) for v in eqn.outvars
                 if eqn.primitive.name == "mpmd_map" and v.aval.dtype == jnp.float32]
        return max(sizes)

    assert largest_f32(FUSED) == q_size
    assert largest_f32(dataclasses.replace(FUSED, fused_launches=4)) == q_size // 4


def test_split_lowers_for_sm90():
    """dK and dV written in place through refs, and dQ's ref threaded through the launches,
    lower for sm_90; the launches call one lowered function (Mosaic GPU's lowering costs
    seconds per kernel)."""
    seq = 1001
    q, k, v, _, stats, do, _ = backward_args(2, seq, seq, 4, 2, 128, jnp.bfloat16)
    spec = make_spec(seq, seq, 128, jnp.bfloat16, causal=True, interpret=False)
    cfg = dataclasses.replace(FUSED, fused_launches=2)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a, config=cfg))
    text = fn.trace(q, k, v, q, stats, do, stats.m).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    calls = [line for line in text.splitlines() if " = call @wrapper(" in line]
    assert len(calls) == 2, calls
    assert text.count("func.func private @wrapper(") == 1


@needs_hopper
def test_split_under_jit_vmap_and_grad(monkeypatch):
    """The split backward through flash_attention's custom_vjp, under jax.vmap (folded into
    the batch) and jax.grad, against the reference in float32. The rule's thresholds are
    lowered so that a small case splits."""
    monkeypatch.setattr(schedule, "FUSED_SPLIT_BYTES", 0)
    monkeypatch.setattr(schedule, "FUSED_MIN_WAVES", 0)
    b, seq, hq, hkv, d, dtype = 2, 128, 4, 2, 64, jnp.bfloat16
    q, k, v, do = random_inputs(jax.random.PRNGKey(81), b, seq, seq, hq, hkv, d, dtype)

    def grads(fn):
        def one(q, k, v, do):
            return jnp.sum(fn(q[None], k[None], v[None]).astype(jnp.float32) * do[None])
        return jax.vmap(jax.grad(one, argnums=(0, 1, 2)))

    ours = grads(lambda q, k, v: pf.flash_attention(q, k, v, causal=True, backend="mosaic"))
    names = kernel_names(ours, q, k, v, do)
    assert fused.FUSED_KERNEL_NAME in names, names
    assert _launches_of(ours, q, k, v, do) == 3        # the forward and two fused launches
    # Waited for before the reference is dispatched (tests/helpers.py, outputs_and_grads).
    got = jax.block_until_ready(jax.jit(ours)(q, k, v, do))
    want = grads(lambda q, k, v: pf.reference_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), causal=True))(
        q, k, v, do.astype(jnp.float32))
    tol = TOLERANCE[jnp.dtype(dtype)]
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(name, g, w, tol)


@pytest.mark.parametrize("b,seq,hq,hkv,d,want", [
    (1, 8192, 16, 16, 128, 1),        # a 64 MiB float32 sum: one launch
    (1, 32768, 16, 16, 128, 4),       # 256 MiB: 8 launches would have 512 CTAs < 4 waves
    (1, 1 << 20, 16, 16, 128, 8),     # 8 GiB: the most launches
    (1, 1 << 20, 32, 2, 128, 2),      # GQA: launches divide the kv heads
    (1, 1 << 20, 8, 1, 128, 1),       # MQA: one kv head, one launch
    (4, 65536, 16, 4, 64, 4),
])
def test_fused_launches_rule(b, seq, hq, hkv, d, want):
    n_tiles = -(-seq // 128)
    cfg = MosaicBackwardConfig(fused=True)
    got = schedule.fused_launches(cfg, b, seq, hq, hkv, d, n_tiles)
    assert got == want
    if got > 1:   # each launch keeps the waves the rule promises
        assert hkv // got * n_tiles * b >= 4 * 132


def test_fused_launches_config():
    assert schedule.fused_launches(MosaicBackwardConfig(fused_launches=2), 1, 128, 4, 4, 64,
                                   1) == 2
    with pytest.raises(ValueError, match="fused_launches"):
        schedule.fused_launches(MosaicBackwardConfig(fused_launches=3), 1, 128, 4, 4, 64, 1)
    with pytest.raises(ValueError, match="fused_launches"):
        MosaicBackwardConfig(fused_launches=0)



def _causal_ds(q, k, v, do):
    """(dS [b, hq, q, k], D [b, hq, q]) of causal attention, in float32."""
    group = q.shape[2] // k.shape[2]
    kx, vx = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = q.shape[1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kx) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf), axis=-1)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, jnp.einsum("bhqk,bkhd->bqhd", p, vx))
    return p * (jnp.einsum("bqhd,bkhd->bhqk", do, vx) - delta[..., None]), delta


def _scaled_ds_max(q, k, v, do):
    """max |dS| divided by dK's and by dQ's cast factors."""
    group = q.shape[2] // k.shape[2]
    ds, delta = _causal_ds(q, k, v, do)
    per_key = fused.dk_cast_scales(v, do, delta, group, keys=128)        # [b, hkv, 128]
    per_query = fused.dq_cast_scales(v, do, delta, group)                # [b, hq, s]
    assert bool((per_key[:, :, q.shape[1]:] == 1).all())                 # the padding
    assert float(per_key.max()) > 1 and float(per_query.max()) > 1       # the premise
    key_factor = jnp.repeat(per_key[:, :, :q.shape[1]], group, axis=1)[:, :, None, :]
    return float(jnp.abs(ds / key_factor).max()), float(jnp.abs(ds / per_query[..., None]).max())


def test_float16_cast_factors_bound_every_ds():
    """dS divided by either cast factor (per key for dK, per query for dQ) stays within
    F16_CAST_LIMIT for every entry, on random operands large enough that both factors
    exceed 1."""
    b, s, hq, hkv, d = 1, 96, 4, 2, 32
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    q = jax.random.normal(ks[0], (b, s, hq, d))
    k = jax.random.normal(ks[1], (b, s, hkv, d))
    v = 300.0 * jax.random.normal(ks[2], (b, s, hkv, d))
    do = 50.0 * jax.random.normal(ks[3], (b, s, hq, d))
    for scaled in _scaled_ds_max(q, k, v, do):
        assert scaled <= fused.F16_CAST_LIMIT * (1 + 1e-5)


def test_float16_cast_factors_are_within_two_of_the_largest_ds():
    """The bound is reached to a factor of two: query 1 splits its weight evenly between
    keys 0 and 1, whose values are opposite, and its cotangent points along them, so
    |dS| = |dO| |V| / 2. A factor any larger would only cost float16 precision."""
    b, s, hq, hkv, d = 1, 2, 2, 1, 4
    e1, e2 = jnp.eye(d)[0], jnp.eye(d)[1]
    q = jnp.broadcast_to(jnp.array([0.3, -0.7, 0.2, 0.5]), (b, s, hq, d))
    k = jnp.broadcast_to(jnp.array([0.4, 0.1, -0.6, 0.9]), (b, s, hkv, d))
    v = 300.0 * jnp.stack([e1, -e1])[None, :, None, :]
    do = 200.0 * jnp.stack([0.1 * e2, e1])[None, :, None, :].repeat(hq, axis=2)
    for scaled in _scaled_ds_max(q, k, v, do):
        assert fused.F16_CAST_LIMIT / 2 * (1 - 1e-4) <= scaled <= fused.F16_CAST_LIMIT * (1 + 1e-5)
