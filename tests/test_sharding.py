"""Batch and head sharding (pallas_flash/sharding.py) on a mesh of host devices.

conftest.py forces four CPU devices, so these run anywhere (interpret mode on the CPU). Each
case compiles forward and backward in one jit and compares O, lse, dq, dk and dv, under random
cotangents for both outputs, with single-device `flash_attention` and with
`reference_attention`; the compiled program must hold no collective.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_flash as pf
from helpers import (assert_close, compare_results, make_mesh, random_inputs, single_device,
                     tolerance)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs at least 2 devices")
F32 = jnp.float32


def _dlse(key, q):
    return jax.random.normal(key, (q.shape[0], q.shape[2], q.shape[1]), F32)


_COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


@pytest.mark.parametrize("batch_axis,head_axis,explicit,segments,head_dim_v", [
    ("data", "heads", False, True, 16),
    (("data", "heads"), None, True, False, 16),
    ("data", "heads", False, False, 8),  # MLA: V's head_dim is its own
])
def test_batch_head_sharding_has_no_collectives(batch_axis, head_axis, explicit, segments,
                                                head_dim_v):
    mesh = make_mesh((2, 2), ("data", "heads"), explicit)
    q, k, v, do = random_inputs(jax.random.PRNGKey(3), 4, 40, 40, 4, 2, 16, F32,
                                head_dim_v=head_dim_v)
    dlse = _dlse(jax.random.PRNGKey(4), q)
    tokens = NamedSharding(mesh, P(batch_axis, None, head_axis, None))
    rows = NamedSharding(mesh, P(batch_axis, head_axis, None))
    args = [jax.device_put(x, tokens) for x in (q, k, v, do)] + [jax.device_put(dlse, rows)]
    options, arrays = dict(causal=True), {}
    if segments:
        # Packed documents plus padding: the per-batch ids must travel with their batch rows.
        ids = jnp.sort(jnp.arange(40)[None, :] % jnp.arange(1, 5)[:, None], axis=1)
        arrays = dict(q_segment_ids=ids, kv_segment_ids=ids, kv_lengths=jnp.array([40, 33, 20, 7]))
        options.update(arrays)
        args += [jax.device_put(ids, NamedSharding(mesh, P(batch_axis, None))),
                 jax.device_put(arrays["kv_lengths"], NamedSharding(mesh, P(batch_axis)))]

    def run(q, k, v, do, dlse, *ids):
        id_options = dict(zip(arrays, (ids[0], ids[0], ids[1]))) if ids else {}

        def attend(q, k, v):
            return pf.sharded_flash_attention(q, k, v, mesh=mesh, batch_axis=batch_axis,
                                              head_axis=head_axis, causal=True,
                                              return_lse=True, **id_options)

        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return out, lse, vjp((do, dlse))

    compiled = jax.jit(run).lower(*args).compile()
    hlo = compiled.as_text()
    found = [c for c in _COLLECTIVES if c in hlo]
    assert not found, f"attention sharded over batch/heads communicates: {found}"
    out, lse, grads = compiled(*args)
    assert out.sharding.is_equivalent_to(tokens, out.ndim)
    assert lse.sharding.is_equivalent_to(rows, lse.ndim)
    assert all(g.sharding.is_equivalent_to(tokens, g.ndim) for g in grads)

    flash, ref = single_device(q, k, v, do, dlse, **options)
    compare_results("vs flash_attention", (out, lse, grads), flash, F32)
    compare_results("vs reference", (out, lse, grads), ref, F32)


@pytest.mark.parametrize("batch_axis,head_axis", [
    ("data", "heads"), (None, ("data", "heads")), (("data", "heads"), None)])
def test_sinks_split_with_the_heads(batch_axis, head_axis):
    """Sinks travel with their heads: each device takes its own heads' sinks, and the sinks'
    gradient, which sums over the batch, is summed over the batch shards too."""
    mesh = make_mesh((2, 2), ("data", "heads"))
    q, k, v, do = random_inputs(jax.random.PRNGKey(13), 4, 24, 24, 4, 4, 16, F32)
    dlse = _dlse(jax.random.PRNGKey(14), q)
    sinks = jax.random.normal(jax.random.PRNGKey(15), (4,), F32)

    def run(attend, q, k, v, sinks):
        (out, lse), vjp = jax.vjp(lambda *a: attend(*a[:3], sinks=a[3]), q, k, v, sinks)
        return out, lse, vjp((do, dlse))

    sharded = functools.partial(pf.sharded_flash_attention, mesh=mesh, batch_axis=batch_axis,
                                head_axis=head_axis, causal=True, return_lse=True)
    single = functools.partial(pf.flash_attention, causal=True, return_lse=True)
    ref = functools.partial(pf.reference_attention, causal=True, return_lse=True)
    got = jax.jit(functools.partial(run, sharded))(q, k, v, sinks)
    for name, want in (("flash_attention", run(single, q, k, v, sinks)),
                       ("reference", run(ref, q, k, v, sinks))):
        compare_results(f"vs {name}", (got[0], got[1], got[2][:3]),
                        (want[0], want[1], want[2][:3]), F32)
        assert_close(f"dsinks vs {name}", got[2][3], want[2][3], tolerance(F32))


def test_sinks_are_checked_against_the_global_heads():
    mesh = make_mesh((2,), ("x",))
    q = k = v = jax.ShapeDtypeStruct((2, 32, 4, 16), F32)
    with pytest.raises(ValueError, match=r"sinks must have shape \[q_heads\] = \(4,\)"):
        pf.sharded_flash_attention(q, k, v, mesh=mesh, head_axis="x",
                                   sinks=jnp.zeros((2,), F32))


def test_collective_check_can_fail():
    """The check above is meaningful: a layout that needs the whole sequence (inputs split
    along seq) makes the compiled program gather or shuffle."""
    mesh = make_mesh((2,), ("data",))
    q, k, v, _ = random_inputs(jax.random.PRNGKey(5), 2, 32, 32, 2, 2, 16, F32)
    along_seq = NamedSharding(mesh, P(None, "data", None, None))
    args = [jax.device_put(x, along_seq) for x in (q, k, v)]
    attend = functools.partial(pf.sharded_flash_attention, mesh=mesh, batch_axis="data")
    hlo = jax.jit(attend).lower(*args).compile().as_text()
    assert any(c in hlo for c in _COLLECTIVES), "expected a collective to reshard seq -> batch"


def test_sharding_errors():
    mesh = make_mesh((2,), ("x",))
    # Shapes are all the checks look at, so no array needs to exist.
    q = jax.ShapeDtypeStruct((2, 32, 4, 16), F32)
    k = v = jax.ShapeDtypeStruct((2, 32, 1, 16), F32)
    with pytest.raises(ValueError, match="number of kv heads \\(1\\).*whole GQA groups"):
        pf.sharded_flash_attention(q, k, v, mesh=mesh, head_axis="x")
    with pytest.raises(ValueError, match="'y' is not an axis of the mesh"):
        pf.sharded_flash_attention(q, k, v, mesh=mesh, batch_axis="y")
    with pytest.raises(ValueError, match="batch size \\(3\\)"):
        odd = [jax.ShapeDtypeStruct((3, *x.shape[1:]), F32) for x in (q, k, v)]
        pf.sharded_flash_attention(*odd, mesh=mesh, batch_axis="x")
    with pytest.raises(TypeError, match="unexpected flash_attention options \\['casual'\\]"):
        pf.sharded_flash_attention(q, k, v, mesh=mesh, casual=True)
