"""Extreme values: huge logits, float16 near its range, degenerate rows, NaN and inf inputs.

What "right" means here:

* Finite inputs whose exact answer is representable: no overflow, no NaN, and the shared
  `check_against_reference` at the shared per-dtype TOLERANCE (never loosened here).
* NaN or inf in an input: the non-finite values appear in exactly the outputs and gradients that
  depend on that input under the mask, and every other value stays finite. The dependency sets
  are derived below from the mask semantics alone (masking.py's docstring), in numpy, not from
  either implementation:
    - O[i] and lse[i] depend on q[i] and on k[j], v[j] for the keys j that row i sees;
    - dq[i] on the same, plus dO[i];
    - dk[j] = sum_i dS[i, j] q[i] and dv[j] = sum_i P[i, j] dO[i] over the rows i that see j,
      where P[i, :] depends on all of row i's keys (through lse[i]) and dS[i, :] also on all of
      row i's values (through D[i] = dO[i] . O[i]).
  An inf input is set up so that the exact answer is NaN (inf - inf in the softmax), or inf for
  an inf in v, whose forward gives inf in one column.
* A row that sees no key: O = 0, lse = -inf, zero gradients, no NaN, even with a non-zero
  cotangent on its lse. Keys that no row sees get dk = dv = 0.
* Padding (q_lengths / kv_lengths) is "never seen": whatever sits in the padded rows of q, k, v,
  NaN included, changes no output and no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from helpers import TOLERANCE, assert_close, check_against_reference, random_inputs

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
F16_MAX = 65504.0
# float16 rounds |x| >= 65520 (halfway to the next binade step) to inf, smaller |x| to finite.
F16_OVERFLOW = 65520.0


def _name(dtype):
    return jnp.dtype(dtype).name


def _grads(q, k, v, do, dlse, **kwargs):
    """O, lse and (dq, dk, dv) of flash_attention for the cotangents (do, dlse), as numpy."""
    (out, lse), vjp = jax.vjp(
        lambda q, k, v: pf.flash_attention(q, k, v, return_lse=True, **kwargs), q, k, v)
    dq, dk, dv = vjp((do.astype(out.dtype), dlse.astype(lse.dtype)))
    as_np = lambda x: np.asarray(x.astype(jnp.float32) if x.dtype != jnp.float64 else x)  # noqa
    return as_np(out), as_np(lse), as_np(dq), as_np(dk), as_np(dv)


def _dlse(q, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (q.shape[0], q.shape[2], q.shape[1]))


def _assert_finite(**arrays):
    for name, x in arrays.items():
        bad = ~np.isfinite(np.asarray(x, np.float64))
        assert not bad.any(), (
            f"{name}: {bad.sum()} non-finite values, first at {np.argwhere(bad)[:5].tolist()}")


# ---- 1. huge logits ---------------------------------------------------------------------------

def _large_logit_inputs(kind, dtype, head_dim=64):
    """q, k, v, dO and the scale for logits of magnitude ~1e4, built three ways.

    one_hot_scale:  normal inputs, scale = 1e4 / sqrt(head_dim): logits ~ N(0, 1e4^2), so each
                    softmax row is (numerically) one-hot.
    one_hot_inputs: q and k times 100, default scale: the same logits from large inputs.
    offset:         every logit is 8192 + a small integer / 8 (spread of a few units, so the
                    softmax is spread, not one-hot). Inputs are small integers and the scale a
                    power of two, so every logit is exact in every dtype and float32 reference:
                    the comparison is well conditioned, not dominated by rounding the inputs.
    """
    q, k, v, do = random_inputs(jax.random.PRNGKey(21), 1, 70, 90, 4, 2, head_dim, F32)
    if kind == "one_hot_scale":
        return q.astype(dtype), k.astype(dtype), v.astype(dtype), do.astype(dtype), \
            1e4 / np.sqrt(head_dim)
    if kind == "one_hot_inputs":
        return (q * 100).astype(dtype), (k * 100).astype(dtype), v.astype(dtype), \
            do.astype(dtype), None
    assert kind == "offset"
    rng = np.random.default_rng(0)
    qi = rng.integers(-2, 3, q.shape).astype(np.float32)
    ki = rng.integers(-2, 3, k.shape).astype(np.float32)
    qi[..., 0], ki[..., 0] = 256.0, 256.0   # 256 * 256 = 65536; / sqrt(64) = 8192
    return jnp.asarray(qi, dtype), jnp.asarray(ki, dtype), v.astype(dtype), do.astype(dtype), None


# float32 cases ask for full float32 matmuls: at logits ~1e4 tf32's 10-bit operands would move
# each logit by ~5, which no tolerance can absorb (tf32 has its own test in test_attention.py).
HIGHEST = dict(precision="highest")


def _f32_options(dtype):
    return HIGHEST if dtype == F32 else {}


@pytest.mark.parametrize("dtype,kind", [
    (F32, "one_hot_scale"), (F32, "one_hot_inputs"), (F32, "offset"),
    (BF16, "one_hot_scale"), (BF16, "offset"),
], ids=lambda x: _name(x) if not isinstance(x, str) else x)
def test_large_logits(dtype, kind):
    q, k, v, do, scale = _large_logit_inputs(kind, dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32)[:, :, :2], k.astype(F32))
    logits = logits * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    assert float(jnp.abs(logits).max()) > 5e3   # the premise: logits really are ~1e4
    # The helper also asserts that O, lse and every gradient are finite.
    check_against_reference(q, k, v, do, causal=True, scale=scale, **_f32_options(dtype))


# ---- 2. float16 near its range -------------------------------------------------------------------

def _f16_near_max(shape, key):
    """Values with |x| in [65056, 65504] (the top 15 float16 steps) and random signs."""
    k1, k2 = jax.random.split(key)
    steps = jax.random.randint(k1, shape, 0, 15)
    sign = jnp.where(jax.random.bernoulli(k2, 0.5, shape), 1.0, -1.0)
    return (sign * (F16_MAX - 32.0 * steps)).astype(F16)


def test_f16_large_q_k_accumulate_in_f32():
    # |q|, |k| up to 200: q.k reaches ~1e5-1e6, far past float16's 65504, so a float16 dot
    # would overflow; the kernel's dots accumulate in float32. Logits ~1e4-1e5: one-hot rows.
    q, k, v, do = random_inputs(jax.random.PRNGKey(31), 1, 100, 120, 4, 2, 64, F32)
    q = jnp.clip(q * 100, -200, 200).astype(F16)
    k = jnp.clip(k * 100, -200, 200).astype(F16)
    qk = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32)[:, :, :2], k.astype(F32))
    assert float(jnp.abs(qk).max()) > F16_MAX   # the premise
    check_against_reference(q, k, v.astype(F16), do.astype(F16), causal=True)


@pytest.mark.parametrize("logits", ["moderate", "large"])
def test_f16_values_near_max_forward(logits):
    # v at the top of float16's range. O is a convex combination of rows of v, so the exact O
    # is representable (|O| <= max |v|), and so is the reference's (computed in float32, then
    # rounded): it never rounds past 65504. The kernel's O must be finite and match it.
    # "large": |q|, |k| ~ 200 as well, one-hot rows (logits ~1e5).
    q, k, _, _ = random_inputs(jax.random.PRNGKey(32), 1, 100, 120, 2, 1, 64, F32)
    if logits == "large":
        q, k = jnp.clip(q * 100, -200, 200), jnp.clip(k * 100, -200, 200)
    q, k = q.astype(F16), k.astype(F16)
    v = _f16_near_max(k.shape, jax.random.PRNGKey(33))
    out, lse = pf.flash_attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = pf.reference_attention(q.astype(F32), k.astype(F32), v.astype(F32),
                                              causal=True, return_lse=True)
    ref_out = np.asarray(ref_out)
    assert np.abs(ref_out).max() <= F16_MAX
    _assert_finite(out=out, lse=lse)
    assert_close("out", out, ref_out.astype(np.float16), TOLERANCE[jnp.dtype(F16)])
    assert_close("lse", lse, ref_lse, TOLERANCE[jnp.dtype(F16)], floor=1.0)


def test_f16_values_near_max_gradients_representable():
    # v near 65504, with a small output cotangent so that every exact gradient (and the
    # reference's float32 one) fits in float16: the whole check must pass as usual.
    q, k, _, do = random_inputs(jax.random.PRNGKey(34), 1, 100, 120, 2, 1, 64, F32)
    v = _f16_near_max(k.shape, jax.random.PRNGKey(35))
    do = (do * 1e-3).astype(F16)
    check_against_reference(q.astype(F16), k.astype(F16), v, do, causal=True)


def test_f16_values_near_max_gradients_that_overflow():
    # v near 65504 and a unit cotangent: dP = dO . v ~ 1e5, and some exact gradients exceed
    # float16's range. The reference computes them in float32 and stays finite; rounded to
    # float16 they would be inf. So the comparison is split by the float32 reference value:
    #   |ref| < 65504 * (1 - tol): the exact value is representable; the kernel must be finite
    #                              there and match at the float16 tolerance;
    #   |ref| > 65520 * (1 + tol): the exact value is not; the kernel must give inf of its sign
    #                              (what rounding a float32 result to float16 gives), not NaN;
    #   in between: rounding can go either way, not checked.
    q, k, _, do = random_inputs(jax.random.PRNGKey(34), 1, 100, 120, 2, 1, 64, F32)
    q, k, do = q.astype(F16), k.astype(F16), do.astype(F16)
    v = _f16_near_max(k.shape, jax.random.PRNGKey(35))
    dlse = _dlse(q)
    tol = TOLERANCE[jnp.dtype(F16)]
    _, _, *grads = _grads(q, k, v, do, dlse, causal=True)
    up = lambda x: x.astype(F32)  # noqa: E731
    _, ref_vjp = jax.vjp(lambda q, k, v: pf.reference_attention(q, k, v, causal=True,
                                                                return_lse=True),
                         up(q), up(k), up(v))
    ref_grads = [np.asarray(g) for g in ref_vjp((up(do), dlse))]
    n_over, errors = 0, []
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        fits = np.abs(rg) < F16_MAX * (1 - tol)
        over = np.abs(rg) > F16_OVERFLOW * (1 + tol)
        n_over += over.sum()
        bad = fits & ~np.isfinite(g)
        if bad.any():
            at = tuple(np.argwhere(bad)[0])
            errors.append(f"{name}: {bad.sum()} of the {fits.sum()} values whose exact gradient "
                          f"fits in float16 are not finite; e.g. at {list(map(int, at))}: got "
                          f"{g[at]}, reference {rg[at]:.6g}")
        else:
            try:
                assert_close(name, np.where(fits, g, 0.0), np.where(fits, rg, 0.0), tol)
            except AssertionError as e:
                errors.append(str(e))
        wrong = over & (g != np.where(rg > 0, np.inf, -np.inf))
        if wrong.any():
            errors.append(f"{name}: {wrong.sum()} of the {over.sum()} out-of-range gradients are "
                          f"not inf of the reference's sign; e.g. got {g[wrong][:3]}, reference "
                          f"{rg[wrong][:3]}")
    assert n_over > 0   # the premise: some exact gradients do overflow float16
    assert not errors, "\n".join(errors)


# ---- 3. degenerate rows --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,magnitude", [
    (F32, 1.0), (BF16, 1.0), (F16, 1.0), (F32, 1e4), (BF16, 1e4),
], ids=lambda x: _name(x) if not isinstance(x, float) else f"logits~{x:g}")
def test_all_logits_equal(dtype, magnitude):
    # All keys of a (batch, kv head) are one vector, so every row's logits are all equal (to
    # ~magnitude): the softmax is exactly uniform over the keys the row sees (causal:
    # O[i] = mean(v[:i+1])).
    q, k, v, do = random_inputs(jax.random.PRNGKey(41), 1, 70, 70, 4, 2, 64, F32)
    k = jnp.broadcast_to(k[:, :1], k.shape)
    scale = magnitude / np.sqrt(64)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    out, _, _ = check_against_reference(q, k, v, do, causal=True, scale=scale,
                                        **_f32_options(dtype))
    mean_v = np.cumsum(np.asarray(v, np.float32), axis=1) / np.arange(1, 71)[None, :, None, None]
    assert_close("out vs running mean of v", out, np.repeat(mean_v, 2, axis=2),
                 TOLERANCE[jnp.dtype(dtype)])


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_name)
def test_one_logit_dominates_by_1e3(dtype):
    # Key 5's logit exceeds every other by ~1e3 (coordinate 0: q = 1, k[5] = 1e3 / scale), so
    # each row that sees it has O = v[5] (exp(-1e3) = 0); rows 0-4 (causal) do not see it and
    # stay ordinary rows.
    q, k, v, do = random_inputs(jax.random.PRNGKey(42), 1, 70, 70, 4, 2, 64, F32)
    scale = 1 / np.sqrt(64)
    q = q.at[..., 0].set(1.0)
    k = k.at[..., 0].set(0.0).at[:, 5, :, 0].set(1e3 / scale)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    out, _, _ = check_against_reference(q, k, v, do, causal=True, **_f32_options(dtype))
    out = np.asarray(out, np.float32)
    v5 = np.repeat(np.asarray(v[:, 5:6], np.float32), 2, axis=2)
    np.testing.assert_allclose(out[:, 5:], np.broadcast_to(v5, out[:, 5:].shape),
                               rtol=TOLERANCE[jnp.dtype(dtype)])


# ---- 4. NaN and inf inputs ----------------------------------------------------------------------

def visibility(batch, seq_q, seq_kv, *, causal=False, causal_alignment="top_left", window=None,
               q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None):
    """[batch, seq_q, seq_kv] bool: may query i see key j. The documented rule, in numpy."""
    i = np.arange(seq_q)[:, None]
    j = np.arange(seq_kv)[None, :]
    offset = seq_kv - seq_q if causal_alignment == "bottom_right" else 0
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    vis = np.ones((batch, seq_q, seq_kv), bool)
    if right is not None:
        vis &= (j <= i + offset + right)[None]
    if left is not None:
        vis &= (j >= i + offset - left)[None]
    if q_lengths is not None:
        vis &= (i[None] < np.asarray(q_lengths)[:, None, None])
    if kv_lengths is not None:
        vis &= (j[None] < np.asarray(kv_lengths)[:, None, None])
    if q_segment_ids is not None:
        vis &= np.asarray(q_segment_ids)[:, :, None] == np.asarray(kv_segment_ids)[:, None, :]
    return vis


def affected(which, vis, b0, pos, head, group, q_heads):
    """Where a non-finite value at q[b0, pos, head] (which="q") or k/v[b0, pos, head] must show.

    Returns bool arrays: rows of O / lse / dq [batch, seq_q, q_heads], rows of dk and of dv
    [batch, seq_kv, kv_heads].
    """
    batch, seq_q, seq_kv = vis.shape
    rows = np.zeros((batch, seq_q, q_heads), bool)
    dk_rows = np.zeros((batch, seq_kv, q_heads // group), bool)
    dv_rows = dk_rows.copy()
    if which == "q":
        rows[b0, pos, head] = vis[b0, pos].any()
        dk_rows[b0, :, head // group] = vis[b0, pos]
        dv_rows[b0, :, head // group] = vis[b0, pos]
    else:
        sees = vis[b0, :, pos]                       # the query rows that see key `pos`
        for h in range(head * group, (head + 1) * group):
            rows[b0, :, h] = sees
        co_visible = vis[b0][sees].any(axis=0)       # keys that some such row also sees
        dk_rows[b0, :, head] = co_visible
        # dv[j] = sum_i P[i, j] dO[i] does not involve v at all; P involves q and k.
        dv_rows[b0, :, head] = co_visible if which == "k" else False
    return rows, dk_rows, dv_rows


def _ranges(rows):
    """[batch, seq, head] bool -> "b1 h2: 32-39, 41" (readable row sets for messages)."""
    parts = []
    for b, h in sorted({(b, h) for b, _, h in np.argwhere(rows)}):
        seq = np.flatnonzero(rows[b, :, h])
        runs = np.split(seq, np.flatnonzero(np.diff(seq) > 1) + 1)
        parts.append(f"b{b} h{h}: " + ", ".join(
            f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs))
    return "; ".join(parts) or "none"


def _row_errors(name, x, expected_rows, want="nan"):
    """x [batch, seq, heads, head_dim]: non-finite (NaN if want == "nan") in exactly the
    expected rows, all finite elsewhere. Returns the list of what is wrong."""
    row_bad = (np.isnan(x) if want == "nan" else ~np.isfinite(x)).any(axis=-1)
    row_finite = np.isfinite(x).all(axis=-1)
    missing = expected_rows & ~row_bad
    extra = ~expected_rows & ~row_finite
    errors = []
    if missing.any():
        errors.append(f"{name}: {missing.sum()} of the {expected_rows.sum()} dependent rows have "
                      f"no {'NaN' if want == 'nan' else 'non-finite value'}: {_ranges(missing)}")
    if extra.any():
        errors.append(f"{name}: {extra.sum()} rows that do not depend on the bad input are not "
                      f"finite: {_ranges(extra)}")
    return errors


MASKS = {
    # 96 x 96 causal: position 40 sits inside a 32- or 64-row tile, after rows that cannot
    # see it (32..39 / 0..39) and that share its tile.
    "causal": (96, 96, lambda: dict(causal=True)),
    # Cross lengths, bottom-right causal window, packed documents and a padded batch row.
    "window_docs": (80, 96, lambda: dict(
        causal=True, causal_alignment="bottom_right", window=(24, None),
        q_segment_ids=jnp.asarray([[0] * 30 + [1] * 50, [0] * 45 + [1] * 35], jnp.int32),
        kv_segment_ids=jnp.asarray([[0] * 50 + [1] * 46, [0] * 61 + [1] * 35], jnp.int32),
        kv_lengths=jnp.asarray([96, 90], jnp.int32))),
}


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_nonfinite_input_reaches_exactly_the_dependent_rows(mask, which, value):
    seq_q, seq_kv, options = MASKS[mask]
    options = options()
    q_heads, kv_heads, head_dim = 4, 2, 32
    group = q_heads // kv_heads
    q, k, v, do = random_inputs(jax.random.PRNGKey(51), 2, seq_q, seq_kv, q_heads, kv_heads,
                                head_dim, F32)
    b0, pos, d0 = 1, 40, 3
    head = 1   # q head 1 (kv head 0), or kv head 1 (q heads 2 and 3)
    bad = jnp.nan if value == "nan" else jnp.inf
    if which == "q":
        q = q.at[b0, pos, head, d0].set(bad)
        if value == "inf":   # every logit of the row is +inf: the softmax is inf / inf = NaN
            k = k.at[b0, :, head // group, d0].set(jnp.abs(k[b0, :, head // group, d0]) + 0.5)
    elif which == "k":
        k = k.at[b0, pos, head, d0].set(bad)
        if value == "inf":   # every row that sees key 40 has a +inf logit: inf - inf = NaN
            heads = slice(head * group, (head + 1) * group)
            q = q.at[b0, :, heads, d0].set(jnp.abs(q[b0, :, heads, d0]) + 0.5)
    else:
        v = v.at[b0, pos, head, d0].set(bad)
    vis = visibility(2, seq_q, seq_kv, **options)
    rows, dk_rows, dv_rows = affected(which, vis, b0, pos, head, group, q_heads)
    assert rows.any() and rows.sum() < rows.size   # the premise: some rows affected, not all

    out, lse, dq, dk, dv = _grads(q, k, v, do, _dlse(q), **options)

    errors = []
    want = "nan" if value == "nan" else "nonfinite"
    if which == "v":
        # The contract is per row: a row that sees the bad value is not finite (the exact answer
        # is non-finite in column d0 only, but the kernel may mark the whole row NaN: keeping
        # columns exact would cost a block matmul that does not fit shared memory). Every row
        # that does not see it stays finite in every column.
        errors += _row_errors("out", out, rows, want)
        # v cannot change lse: -inf exactly on the rows that see no key, finite elsewhere.
        sees_none = np.broadcast_to(~vis.any(axis=2)[:, None, :], lse.shape)
        wrong = np.where(sees_none, lse != -np.inf, ~np.isfinite(lse))
        if wrong.any():
            errors.append(f"lse: {wrong.sum()} wrong values (v cannot change lse): "
                          f"{_ranges(wrong.transpose(0, 2, 1))}")
    else:
        errors += _row_errors("out", out, rows, "nan")
        lse_rows = lse.transpose(0, 2, 1)   # [batch, seq_q, heads]
        not_nan = rows & ~np.isnan(lse_rows)
        if not_nan.any():
            errors.append(f"lse: {not_nan.sum()} of the {rows.sum()} dependent rows are not NaN "
                          f"(values {np.unique(lse_rows[not_nan]).tolist()[:4]}): "
                          f"{_ranges(not_nan)}")
        extra = ~rows & np.isnan(lse_rows)
        if extra.any():
            errors.append(f"lse: NaN on {extra.sum()} rows that do not depend on the bad input: "
                          f"{_ranges(extra)}")
    errors += _row_errors("dq", dq, rows, want)
    errors += _row_errors("dk", dk, dk_rows, want)
    errors += _row_errors("dv", dv, dv_rows, want)
    assert not errors, (f"{value} at {which}[{b0}, {pos}, {head}, {d0}] ({mask}):\n  "
                        + "\n  ".join(errors))


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_garbage_in_padding_is_never_seen(which, value):
    # Padded rows (past q_lengths / kv_lengths) hold NaN or inf, as an uninitialised KV cache
    # or a padded batch may: every output and gradient must equal the one computed with zeros
    # in the padding, bit for bit; padded rows give O = 0, lse = -inf and zero gradients.
    q, k, v, do = random_inputs(jax.random.PRNGKey(61), 2, 70, 90, 2, 1, 32, F32)
    q_lengths = jnp.asarray([50, 70], jnp.int32)
    kv_lengths = jnp.asarray([90, 41], jnp.int32)
    q_pad = np.arange(70)[None, :] >= np.asarray(q_lengths)[:, None]     # [batch, seq_q]
    kv_pad = np.arange(90)[None, :] >= np.asarray(kv_lengths)[:, None]   # [batch, seq_kv]
    clean = dict(q=jnp.where(q_pad[:, :, None, None], 0.0, q),
                 k=jnp.where(kv_pad[:, :, None, None], 0.0, k),
                 v=jnp.where(kv_pad[:, :, None, None], 0.0, v))
    dirty = dict(clean)
    pad = q_pad if which == "q" else kv_pad
    dirty[which] = jnp.where(pad[:, :, None, None], jnp.nan if value == "nan" else jnp.inf,
                             clean[which])
    options = dict(causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths)
    dlse = _dlse(q)
    expected = _grads(clean["q"], clean["k"], clean["v"], do, dlse, **options)
    got = _grads(dirty["q"], dirty["k"], dirty["v"], do, dlse, **options)
    errors = []
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        if name == "lse":
            g, e = g.transpose(0, 2, 1)[..., None], e.transpose(0, 2, 1)[..., None]
        changed = ~((g == e) | (np.isnan(g) & np.isnan(e))).all(axis=-1)
        if changed.any():
            non_finite = ~np.isfinite(g).all(axis=-1)
            errors.append(f"{name}: {changed.sum()} rows changed ({(changed & non_finite).sum()} "
                          f"of them now non-finite): {_ranges(changed)}")
    assert not errors, (f"{value} in the padded rows of {which} (q_lengths {[50, 70]}, "
                        f"kv_lengths {[90, 41]}, causal):\n  " + "\n  ".join(errors))
    out, lse, dq, dk, dv = got
    assert (out[q_pad] == 0).all() and (dq[q_pad] == 0).all()
    assert (lse.transpose(0, 2, 1)[q_pad] == -np.inf).all()
    assert (dk[kv_pad] == 0).all() and (dv[kv_pad] == 0).all()


# ---- 5. rows that see no key -------------------------------------------------------------------

def _empty_row_case(kind):
    """(seq_q, seq_kv, options) with query rows that see no key (and, but for the window case,
    keys that no row sees)."""
    if kind == "window":
        # Bottom-right alignment with seq_q > seq_kv: offset -40, window (3, 0): rows 0-39 see
        # nothing; rows 40-79 see keys i-43 .. i-40. (The last row sees the last key.)
        return 80, 40, dict(causal=True, causal_alignment="bottom_right", window=(3, 0))
    if kind == "segments":
        # Batch 0: query document 2 has no keys; key document 1 has no queries. Batch 1:
        # disjoint ids, nothing is seen at all.
        q_ids = [[0] * 20 + [2] * 30 + [3] * 30, [5] * 80]
        kv_ids = [[0] * 25 + [1] * 20 + [3] * 35, [6] * 80]
        return 80, 80, dict(q_segment_ids=jnp.asarray(q_ids, jnp.int32),
                            kv_segment_ids=jnp.asarray(kv_ids, jnp.int32))
    assert kind == "lengths"
    # Batch 0: 33 valid queries, 0 valid keys (every row empty). Batch 1: 80 / 57.
    return 80, 80, dict(q_lengths=jnp.asarray([33, 80], jnp.int32),
                        kv_lengths=jnp.asarray([0, 57], jnp.int32))


@pytest.mark.parametrize("dtype,kind", [
    (F32, "window"), (F32, "segments"), (F32, "lengths"), (BF16, "segments"),
], ids=lambda x: _name(x) if not isinstance(x, str) else x)
def test_rows_that_see_no_key(dtype, kind):
    seq_q, seq_kv, options = _empty_row_case(kind)
    q, k, v, do = random_inputs(jax.random.PRNGKey(71), 2, seq_q, seq_kv, 4, 2, 48, dtype)
    vis = visibility(2, seq_q, seq_kv, **options)
    empty_q = ~vis.any(axis=2)    # [batch, seq_q]
    unseen_k = ~vis.any(axis=1)   # [batch, seq_kv]
    assert empty_q.any() and empty_q.sum() < empty_q.size   # the premise
    assert unseen_k.any() or kind == "window"
    # A random finite cotangent on every lse, the -inf ones included: lse = -inf is a constant
    # there, so it must contribute nothing (and no inf * 0).
    dlse = _dlse(q, seed=72)
    assert (np.asarray(dlse) != 0).all()
    out, lse, dq, dk, dv = _grads(q, k, v, do, dlse, **options)
    _assert_finite(out=out, dq=dq, dk=dk, dv=dv)
    assert not np.isnan(lse).any()
    lse = lse.transpose(0, 2, 1)
    assert (out[empty_q] == 0).all(), "O is not 0 on rows that see no key"
    assert (lse[empty_q] == -np.inf).all(), "lse is not -inf on rows that see no key"
    assert np.isfinite(lse[~empty_q]).all(), "lse is not finite on rows that see a key"
    assert (dq[empty_q] == 0).all(), "dq is not 0 on rows that see no key"
    assert (dk[unseen_k] == 0).all() and (dv[unseen_k] == 0).all(), (
        "dk / dv are not 0 on keys that no row sees")
    assert not (out[~empty_q] == 0).all(axis=-1).any(), "a row that sees keys has O = 0"


def test_huge_window_sides_mean_the_whole_sequence():
    """A window side past validation.MAX_WINDOW bounds nothing; clamped, it stays out of the
    masks' int32 overflow and gives what a side of the sequence's length gives."""
    q, k, v, _ = random_inputs(jax.random.PRNGKey(71), 1, 24, 24, 2, 2, 16, jnp.float32)
    for huge, whole in (((2**32, 0), (24, 0)), ((0, 2**31), (0, 24))):
        np.testing.assert_array_equal(
            np.asarray(pf.flash_attention(q, k, v, window=huge, interpret=True)),
            np.asarray(pf.flash_attention(q, k, v, window=whole, interpret=True)))
