"""The one comparison helper every kernel test uses, and the per-dtype tolerance table.

`check_against_reference` runs flash_attention and reference_attention (float32 math, or
float64 for float64 inputs) on the same inputs, with random cotangents for both outputs, and
compares O, lse, dq, dk and dv by relative Frobenius error. A failure reports the error, the
tolerance and the worst element, like np.testing does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType

import pallas_flash as pf
from pallas_flash.masking import make_mask_spec
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import RowStats

ON_GPU = jax.default_backend() == "gpu"

# Relative Frobenius error ||x - ref|| / ||ref|| allowed for each input dtype.
#  - bf16/f16: operands carry 8/11 mantissa bits and P is rounded to the input dtype before the
#    P.V and dS.K products (as in every FlashAttention); measured errors sit near 3e-3 (bf16) and
#    4e-4 (f16) for O, up to 3x that for gradients.
#  - float32 on the GPU: matmuls run as tf32 (10 mantissa bits) by default, like XLA; about 3e-4
#    was measured on our H200 for plain attention.
#  - float32 / float64 in interpret mode: exact-arithmetic differences only.
TOLERANCE = {
    jnp.dtype(jnp.bfloat16): 2e-2,
    jnp.dtype(jnp.float16): 4e-3,
    jnp.dtype(jnp.float32): 2e-3 if ON_GPU else 1e-5,
    jnp.dtype(jnp.float64): 1e-10,
}
# float32 with precision="highest" (ieee matmuls): float32 rounding only, on the CPU and the GPU.
F32_HIGHEST = 1e-5


def tolerance(dtype, precision=None) -> float:
    """The TOLERANCE entry, or F32_HIGHEST for float32 asked to run at precision="highest"."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32 and str(precision).lower() in ("highest", "precision.highest"):
        return F32_HIGHEST
    return TOLERANCE[dtype]


def random_inputs(key, batch, seq_q, seq_kv, q_heads, kv_heads, head_dim, dtype, *,
                  head_dim_v=None):
    """Fresh normal q, k, v and a normal output cotangent (never zeros or ones); v and the
    cotangent have head_dim_v columns where given (MLA), else head_dim."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, seq_q, q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, seq_kv, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, seq_kv, kv_heads, head_dim_v), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (batch, seq_q, q_heads, head_dim_v), jnp.float32).astype(dtype)
    return q, k, v, do


def relative_error(actual, expected, floor=0.0) -> float:
    """||a - e|| / ||e||, with ||e|| taken as at least floor * sqrt(size)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    scale = max(np.linalg.norm(e), floor * np.sqrt(e.size), 1e-30)
    return float(np.linalg.norm(a - e) / scale)


def assert_close(name, actual, expected, tol, floor=0.0):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{name}: {np.sum(~np.isfinite(actual))} non-finite values"
    err = relative_error(actual, expected, floor)
    if not err <= tol:
        diff = np.abs(actual - expected)
        worst = np.unravel_index(np.argmax(diff), diff.shape)
        raise AssertionError(
            f"{name}: relative error {err:.3e} > tolerance {tol:.1e}\n"
            f"  worst element {worst}: actual {actual[worst]!r}, expected {expected[worst]!r}, "
            f"|diff| {diff[worst]:.3e}; max |expected| {np.abs(expected).max():.3e}"
        )


def outputs_and_grads(fn, q, k, v, do, dlse, kwargs):
    """O, lse and the vjp (dq, dk, dv) of fn for cotangents (do, dlse), in one jitted call.

    dlse is applied to finite lse entries only: a row that sees no key has lse = -inf in both
    implementations, and its cotangent must not turn into inf * 0. The results are waited for:
    an operation dispatched while an interpreted Mosaic kernel still runs can deadlock with the
    interpreter's callbacks (seen as hangs of the next eager op).
    """

    @jax.jit
    def run(q, k, v, do, dlse):
        (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, return_lse=True, **kwargs), q, k, v)
        dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0).astype(lse.dtype)
        grads = vjp((do.astype(out.dtype), dlse))
        return out, lse, grads

    return jax.block_until_ready(run(q, k, v, do, dlse))


def check_against_reference(q, k, v, do, *, key=None, tol=None, **kwargs):
    """Compares flash_attention with reference_attention on O, lse, dq, dk, dv.

    kwargs are passed to both (causal, window, segment ids, ...). The reference runs on the same
    inputs upcast to float32 (float64 stays float64), so it is the more precise side.
    """
    dtype = jnp.dtype(q.dtype)
    tol = tolerance(dtype, kwargs.get("precision")) if tol is None else tol
    ref_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    key = jax.random.PRNGKey(1) if key is None else key
    dlse = jax.random.normal(key, (q.shape[0], q.shape[2], q.shape[1]), ref_dtype)

    out, lse, grads = outputs_and_grads(pf.flash_attention, q, k, v, do, dlse, kwargs)
    up = lambda x: x.astype(ref_dtype)  # noqa: E731
    # Options that only steer the kernels (how, not what) are not the reference's business.
    kernel_only = ("precision", "config", "backend", "interpret")
    ref_kwargs = {name: value for name, value in kwargs.items() if name not in kernel_only}
    ref_out, ref_lse, ref_grads = outputs_and_grads(
        pf.reference_attention, up(q), up(k), up(v), up(do), dlse, ref_kwargs)

    assert out.dtype == q.dtype and out.shape == (*q.shape[:-1], v.shape[-1])
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    # Rows that see no key must agree exactly on lse = -inf; the rest are compared by value.
    empty = ~np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.asarray(lse) == -np.inf, empty,
                                  err_msg="rows with lse = -inf differ from the reference")
    assert not np.isnan(np.asarray(lse)).any(), "lse has NaN"
    assert_close("out", out, ref_out, tol)
    # lse is a log: its error is absolute in units of the logits, so values near 0 are compared
    # as if they had magnitude 1.
    assert_close("lse", np.where(empty, 0.0, lse), np.where(empty, 0.0, ref_lse), tol, floor=1.0)
    for name, g, rg, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert g.dtype == x.dtype, f"{name} dtype {g.dtype} != input dtype {x.dtype}"
        assert_close(name, g, rg, tol)
    return out, lse, grads


# An H200 to lower for without a GPU: Pallas's Triton lowering asks the device for its compute
# capability, and an abstract mesh's device answers in place of the local one (Mosaic GPU needs
# no device at all).
ABSTRACT_H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                            platform="gpu")


def lower_for_sm90(fn, *args) -> str:
    """The text of fn's jitted program lowered for the cuda platform as for an H200."""
    # Auto axes: an explicit one would put its sharding into the traced types.
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                                     abstract_device=ABSTRACT_H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

def all_eqns(jaxpr):
    """Every equation of jaxpr and of the jaxprs nested in it."""
    import jax.extend

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def kernel_names(fn, *args):
    """Names of the kernels fn stages: Pallas `pallas_call` names and Mosaic `mpmd_map` names,
    through nested jaxprs."""
    return {eqn.params.get("name") for eqn in all_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
            if eqn.primitive.name in ("pallas_call", "mpmd_map")}


@contextlib.contextmanager
def example_module(path, name):
    """Loads a script from examples/ (not a package) as a module, for the duration of a test.

    It is registered in sys.modules while it runs, because dataclasses looks its module up.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


_PRECISIONS = {None: lax.Precision.DEFAULT, "default": lax.Precision.DEFAULT,
               "high": lax.Precision.HIGH, "highest": lax.Precision.HIGHEST}


def make_spec(seq_q, seq_kv, head_dim, dtype, *, causal=False, causal_alignment="top_left",
              window=None, softcap=None, scale=None, has_segments=False, precision=None,
              interpret=None) -> AttentionSpec:
    """The AttentionSpec a kernel receives, built as flash_attention builds it (options named as
    flash_attention names them); interpret mode exactly when there is no GPU, unless told."""
    return AttentionSpec(
        mask=make_mask_spec(seq_q, seq_kv, causal=causal, causal_alignment=causal_alignment,
                            window=window),
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale, softcap=softcap,
        has_segments=has_segments,
        precision=_PRECISIONS[precision],
        config=pf.default_config(head_dim, dtype),
        interpret=(not ON_GPU) if interpret is None else interpret)


def reference_grads(q, k, v, do, dlse, **kwargs):
    """vjp of the float32 reference for cotangents (do, dlse); dlse only on finite lse rows.

    kwargs go to reference_attention (causal, causal_alignment, window, softcap, segment ids,
    lengths)."""
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    fn = lambda q, k, v: pf.reference_attention(q, k, v, return_lse=True, **kwargs)  # noqa: E731
    (_, lse), vjp = jax.vjp(fn, up(q), up(k), up(v))
    return vjp((up(do), jnp.where(jnp.isfinite(lse), dlse, 0.0)))


def backward_args(b, sq, skv, hq, hkv, d, dtype):
    """(q, k, v, out, stats, do, dlse) of the right shapes for tracing a backward (values are
    not checked: q stands in for out, zero statistics)."""
    q, k, v, do = random_inputs(jax.random.PRNGKey(94), b, sq, skv, hq, hkv, d, dtype)
    stats = RowStats(jnp.zeros((b, hq, sq), jnp.float32), jnp.zeros((b, hq, sq), jnp.float32))
    return q, k, v, q, stats, do, stats.m


def make_mesh(shape, names, explicit=False):
    """A mesh of the first devices (conftest.py gives the CPU four); skips the test when there
    are too few. explicit: Explicit axis types (sharding in the type), else Auto."""
    size = int(np.prod(shape))
    if size > len(jax.devices()):
        pytest.skip(f"mesh {dict(zip(names, shape))} needs {size} devices, "
                    f"found {len(jax.devices())}")
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape),
                         devices=jax.devices()[:size])


def compare_results(name, result, expected, dtype):
    """result / expected: (out, lse, (dq, dk, dv)), as outputs_and_grads returns them."""
    tol = TOLERANCE[jnp.dtype(dtype)]
    out, lse, grads = result
    ref_out, ref_lse, ref_grads = expected
    assert_close(f"{name} out", out, ref_out, tol)
    # Rows that see no key must agree on lse = -inf exactly; the rest compare by value.
    empty = np.isneginf(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty, err_msg=f"{name} lse=-inf")
    assert_close(f"{name} lse", np.where(empty, 0.0, lse), np.where(empty, 0.0, ref_lse), tol,
                 floor=1.0)
    for grad_name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(f"{name} {grad_name}", g, rg, tol)


def single_device(q, k, v, do, dlse, **options):
    """(flash_attention's, reference_attention's) outputs_and_grads on one device."""
    flash = outputs_and_grads(pf.flash_attention, q, k, v, do, dlse, options)
    ref = outputs_and_grads(pf.reference_attention, q, k, v, do, dlse, options)
    return flash, ref
