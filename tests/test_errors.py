"""Every invalid input raises a ValueError naming the argument, before any kernel is traced."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from helpers import make_mesh
from pallas_flash import attention, decode, guarded, ring, ring_steps
from pallas_flash.config import shared_memory_bytes, shared_memory_limit
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import decode as mosaic_decode
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import decode as triton_decode
from pallas_flash.triton import forward as triton_forward

# Every kernel entry point a flash_attention or decode_attention call can reach, as (module,
# attribute) on the module objects the dispatch reads them from when a call is traced:
# attention._FORWARDS / _BACKWARDS map each backend to one of these modules, guarded.py calls the
# Mosaic and Triton kernels through their modules, and decode.py looks up `partial` on the
# backend's module and `combine` on triton.decode.
KERNELS = {
    "triton.forward": (triton_forward, "forward"),
    "triton.backward": (triton_backward, "backward"),
    "mosaic.forward": (mosaic_forward, "forward"),
    "mosaic.backward": (mosaic_backward, "backward"),
    "mosaic.backward_checked": (mosaic_backward, "backward_checked"),
    "guarded.forward": (guarded, "forward"),
    "guarded.backward": (guarded, "backward"),
    "triton.decode.partial": (triton_decode, "partial"),
    "mosaic.decode.partial": (mosaic_decode, "partial"),
    "triton.decode.combine": (triton_decode, "combine"),
}
FORWARDS = ("triton.forward", "mosaic.forward", "guarded.forward")


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch):
    """Any kernel reached during these tests is itself a failure: checks must come first.

    Returns the real entry points by KERNELS name, for tests that let a call past one of them.
    """
    real = {name: getattr(module, attr) for name, (module, attr) in KERNELS.items()}
    for name, (module, attr) in KERNELS.items():
        def fail(*args, _name=name, **kwargs):
            raise AssertionError(f"a kernel ({_name}) was reached before the input was rejected")

        monkeypatch.setattr(module, attr, fail)
    # A jitted function cached by an earlier call runs without being traced again, so it would
    # never look the trapped attributes up: every test starts from empty caches.
    attention._custom_vjp_attention.cache_clear()
    decode._decode_fn.cache_clear()
    ring._sharded_fn.cache_clear()
    ring_steps._jitted.cache_clear()
    return real


def qkv(shape_q=(1, 8, 4, 16), shape_kv=(1, 8, 2, 16), dtype=jnp.float32):
    q = jnp.ones(shape_q, dtype)
    k = jnp.ones(shape_kv, dtype)
    return q, k, k


def raises(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        pf.flash_attention(*args, **kwargs)


def test_rank():
    q, k, v = qkv()
    raises(r"q must have rank 4 .* got shape \(8, 4, 16\)", q[0], k, v)
    raises(r"k must have rank 4", q, k[0], v)
    raises(r"v must have rank 4", q, k, v[..., None])


def test_not_an_array():
    q, k, v = qkv()
    raises(r"k must be an array, got list", q, [[1.0]], v)


def test_non_float_dtype():
    q, k, v = qkv()
    raises(r"q must be bfloat16, float16, float32 or float64, got dtype int32",
           q.astype(jnp.int32), k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    raises(r"q, k and v must share one dtype, got q float32, k bfloat16, v float32",
           q, k.astype(jnp.bfloat16), v)


def test_batch_mismatch():
    q, k, v = qkv()
    k2 = jnp.ones((2, 8, 2, 16))
    raises(r"k batch size 2 does not match q batch size 1", q, k2, k2)
    raises(r"v batch size 2 does not match q batch size 1", q, k, k2)


def test_head_dim_mismatch():
    q, k, v = qkv()
    raises(r"k head_dim 32 does not match q head_dim 16", q, jnp.ones((1, 8, 2, 32)), v)
    # v may have a head_dim of its own (MLA: tests/test_mla.py), within the same bound.
    raises(r"v head_dim must be <= 256, got 272", q, k, jnp.ones((1, 8, 2, 272)))


def test_v_shape_differs_from_k():
    q, k, v = qkv()
    raises(r"v must have the seq_kv and kv_heads of k", q, k, jnp.ones((1, 9, 2, 16)))


def test_empty_dimension():
    q, k, v = qkv()
    raises(r"every dimension must be >= 1", q, jnp.ones((1, 0, 2, 16)), jnp.ones((1, 0, 2, 16)))


def test_head_dim_too_large():
    q, k, v = qkv((1, 8, 2, 272), (1, 8, 2, 272))
    raises(r"head_dim must be <= 256, got 272", q, k, v)


def test_heads_not_a_multiple():
    q, k, v = qkv((1, 8, 3, 16), (1, 8, 2, 16))
    raises(r"number of q heads \(3\) must be a multiple of the number of kv heads \(2\)", q, k, v)


def test_causal_must_be_bool():
    raises(r"causal must be a bool", *qkv(), causal="yes")


def test_causal_alignment():
    raises(r"causal_alignment must be one of", *qkv(), causal=True, causal_alignment="bottom")


@pytest.mark.parametrize("scale", [float("inf"), 0.0, -0.5, 1e-40, 1e39])
def test_scale_value(scale):
    # Negative: the kernels' running maximum of q.k is the scaled maximum only for a positive
    # scale. 1e-40 and 1e39 are a subnormal and an infinite float32.
    raises(r"scale must be positive and a normal float32", *qkv(), scale=scale)


def test_scale_type():
    raises(r"scale must be a Python float", *qkv(), scale=jnp.ones(2))


@pytest.mark.parametrize("window,match", [
    ((1, 2, 3), r"window must be a \(left, right\) pair"),
    ((-1, 0), r"window left must be None or an int >= 0"),
    ((0, 1.5), r"window right must be None or an int >= 0"),
])
def test_window(window, match):
    raises(match, *qkv(), window=window)


@pytest.mark.parametrize("softcap", [0.0, -1.0, "big"])
def test_softcap(softcap):
    raises(r"softcap must be None or a positive float", *qkv(), softcap=softcap)


def test_segment_ids_come_in_pairs():
    ids = jnp.zeros((1, 8), jnp.int32)
    raises(r"q_segment_ids and kv_segment_ids must be given together", *qkv(), q_segment_ids=ids)


def test_segment_ids_shape_and_dtype():
    ids = jnp.zeros((1, 8), jnp.int32)
    raises(r"kv_segment_ids must have shape \[batch, seq\] = \(1, 8\), got \(1, 7\)", *qkv(),
           q_segment_ids=ids, kv_segment_ids=ids[:, :7])
    raises(r"q_segment_ids must have an integer dtype, got float32", *qkv(),
           q_segment_ids=ids.astype(jnp.float32), kv_segment_ids=ids)


def test_lengths_shape():
    raises(r"kv_lengths must have shape \[batch\] = \(1,\), got \(2,\)", *qkv(),
           kv_lengths=jnp.array([3, 4]))
    raises(r"q_lengths must have an integer dtype", *qkv(), q_lengths=jnp.array([3.0]))


def test_return_lse_must_be_bool():
    raises(r"return_lse must be a bool", *qkv(), return_lse=1)


def test_precision():
    raises(r"precision must be None, 'default', 'high', 'highest'", *qkv(), precision="fast")


def test_config_type():
    raises(r"config must be a pallas_flash.FlashConfig", *qkv(), config={"block_q": 64})


def test_backend():
    raises(r"backend must be one of", *qkv(), backend="cuda")


def test_interpret_must_be_bool():
    raises(r"interpret must be None or a bool", *qkv(), interpret="auto")


def test_float64_needs_interpret():
    with jax.enable_x64(True):
        raises(r"float64 run in interpret mode only", *qkv(dtype=jnp.float64), interpret=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_q=72, block_kv=64), r"KernelConfig.block_q must be a power of two"),
    (dict(block_q=64, block_kv=8), r"KernelConfig.block_kv must be a power of two in \[16, 256\]"),
    (dict(block_q=64, block_kv=512), r"KernelConfig.block_kv must be a power of two"),
    (dict(block_q=64.0, block_kv=64), r"KernelConfig.block_q must be an int"),
    (dict(block_q=64, block_kv=64, num_warps=3), r"KernelConfig.num_warps must be one of"),
    (dict(block_q=64, block_kv=64, num_stages=0), r"KernelConfig.num_stages must be an int >= 1"),
    (dict(block_q=64, block_kv=64, num_stages=True), r"KernelConfig.num_stages must be an int"),
    (dict(block_q=64, block_kv=64, num_warps=True), r"KernelConfig.num_warps must be one of"),
    (dict(block_q=64, block_kv=64, num_warps=4.0), r"KernelConfig.num_warps must be one of"),
])
def test_kernel_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pf.KernelConfig(**kwargs)


def test_flash_config_fields():
    good = pf.KernelConfig(block_q=64, block_kv=64)
    with pytest.raises(ValueError, match=r"FlashConfig.bwd_dq must be a KernelConfig"):
        pf.FlashConfig(fwd=good, bwd_dkdv=good, bwd_dq=(64, 64))


def test_config_over_shared_memory():
    # The 128x128 dK/dV tile at head_dim 128 asked our H200 for 263168 bytes of shared memory
    # (232448 available) and failed inside the first call; it must be refused up front, on any
    # machine, naming the kernel.
    big = pf.KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=2)
    config = dataclasses.replace(pf.default_config(128, jnp.bfloat16), bwd_dkdv=big)
    raises(r"config.bwd_dkdv \(128x128, 2 stages\) needs about 262144 bytes of shared memory",
           *qkv((1, 8, 2, 128), (1, 8, 2, 128), jnp.bfloat16), config=config)


@pytest.mark.parametrize("head_dim", [8, 32, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_default_configs_fit_shared_memory(head_dim, dtype):
    need = shared_memory_bytes(pf.default_config(head_dim, dtype), head_dim, dtype)
    assert max(need.values()) <= shared_memory_limit(interpret=True), need


def test_reference_validates_too():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k must have rank 4"):
        pf.reference_attention(q, k[0], v)


S = jax.ShapeDtypeStruct


def _attention_call(what, dtype, head_dim, options):
    """(function, abstract arguments): flash_attention's forward, or its gradient."""
    x = S((1, 64, 2, head_dim), dtype)

    def forward(q, k, v):
        return pf.flash_attention(q, k, v, **options)

    def loss(q, k, v):
        return forward(q, k, v).astype(jnp.float32).sum()

    return (forward if what == "forward" else jax.grad(loss, argnums=(0, 1, 2))), (x, x, x)


def _decode_call(dtype, head_dim, options):
    q, cache = S((2, 1, 4, head_dim), dtype), S((2, 256, 2, head_dim), dtype)

    def call(q, k_cache, v_cache, kv_lengths):
        return pf.decode_attention(q, k_cache, v_cache, kv_lengths=kv_lengths, **options)

    return call, (q, cache, cache, S((2,), jnp.int32))


# Each path to a kernel, by id: (what is traced, dtype, head_dim, options, dispatch as on an
# sm_90 GPU, entry points left real, the entry point the call must reach). A backward is reached
# only past a forward, so those cases leave the forwards real; tracing only stages them.
PATHS = {
    "triton-forward": ("forward", jnp.float32, 16, {}, False, (), "triton.forward"),
    "mosaic-forward": ("forward", jnp.bfloat16, 32, dict(backend="mosaic", interpret=True),
                       False, (), "mosaic.forward"),
    "auto-sm90-forward": ("forward", jnp.bfloat16, 32, dict(interpret=False), True, (),
                          "guarded.forward"),
    "triton-backward": ("backward", jnp.float32, 16, {}, False, FORWARDS, "triton.backward"),
    "mosaic-backward": ("backward", jnp.bfloat16, 32, dict(backend="mosaic", interpret=True),
                        False, FORWARDS, "mosaic.backward"),
    "auto-sm90-backward": ("backward", jnp.bfloat16, 32, dict(interpret=False), True, FORWARDS,
                           "guarded.backward"),
    "auto-sm90-backward-checked": ("backward", jnp.bfloat16, 32, dict(interpret=False), True,
                                   FORWARDS + ("guarded.backward",), "mosaic.backward_checked"),
    "triton-decode": ("decode", jnp.float32, 64, {}, False, (), "triton.decode.partial"),
    "mosaic-decode": ("decode", jnp.bfloat16, 128, dict(backend="mosaic", interpret=True), False,
                      (), "mosaic.decode.partial"),
    "decode-combine": ("decode", jnp.float32, 64, dict(num_splits=2), False,
                       ("triton.decode.partial",), "triton.decode.combine"),
}


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_valid_input_reaches_the_kernel(no_kernel, monkeypatch, path):
    # The fixture's trap must catch a valid call on every path to a kernel, or every test above
    # would pass vacuously for the backends it misses. The call is traced and never run, so the
    # sm_90 dispatch ("auto" on an H100/H200: the guarded Mosaic kernels) is taken on any machine.
    what, dtype, head_dim, options, sm90, real, reached = path
    if sm90:
        monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    for name in real:
        monkeypatch.setattr(*KERNELS[name], no_kernel[name])
    if what == "decode":
        fn, args = _decode_call(dtype, head_dim, options)
    else:
        fn, args = _attention_call(what, dtype, head_dim, options)
    with pytest.raises(AssertionError, match=rf"a kernel \({re.escape(reached)}\) was reached"):
        jax.jit(fn).trace(*args)


@pytest.mark.parametrize("head_dim", [0, -5, True, 2.5])
def test_default_config_head_dim(head_dim):
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        pf.default_config(head_dim, jnp.bfloat16)


def test_configs_are_hashable_and_frozen():
    cfg = pf.default_config(128, jnp.bfloat16)
    assert hash(cfg) == hash(pf.default_config(128, np.dtype("bfloat16")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fwd.block_q = 32


# ================================================================================================
# decode_attention: sizes, pages and windows
# ================================================================================================


def decode_raises(match, q_shape=(1, 1, 2, 16), cache_shape=(1, 64, 2, 16), **kwargs):
    q, cache = jnp.ones(q_shape), jnp.ones(cache_shape)
    kwargs.setdefault("kv_lengths", jnp.array([8], jnp.int32))
    with pytest.raises(ValueError, match=match):
        pf.decode_attention(q, cache, cache, **kwargs)


def test_decode_empty_q_names_q_and_its_shape():
    # q is checked against itself by the shared validation, whose message for an empty
    # dimension names k and v: decode's own checks of q come first and report q alone.
    decode_raises(r"^q must hold 1 to 16 new tokens per sequence .* got q_len = 0$",
                  q_shape=(1, 0, 2, 16))
    decode_raises(r"^q dimensions must be >= 1, got \(1, 1, 0, 16\)$", q_shape=(1, 1, 0, 16))
    decode_raises(r"^q dimensions must be >= 1, got \(0, 1, 2, 16\)$", q_shape=(0, 1, 2, 16))


def test_decode_empty_cache():
    decode_raises(r"k_cache dimensions must be >= 1, got \(1, 0, 2, 16\)",
                  cache_shape=(1, 0, 2, 16))


def test_decode_block_table_without_pages():
    decode_raises(r"block_table must hold at least one page per sequence .* got shape \(1, 0\)",
                  cache_shape=(4, 16, 2, 16), block_table=jnp.zeros((1, 0), jnp.int32))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_huge_window_is_the_whole_sequence(no_kernel, monkeypatch, paged):
    # A left side past the cache's length sees every key, as a side of that length does; a
    # side of 2**31 or more would not fit the kernels' int32 arithmetic unclamped.
    for name in ("triton.decode.partial", "triton.decode.combine"):
        monkeypatch.setattr(*KERNELS[name], no_kernel[name])
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (2, 2, 4, 16), jnp.float32)
    k = jax.random.normal(keys[1], (2, 128, 2, 16), jnp.float32)
    v = jax.random.normal(keys[2], (2, 128, 2, 16), jnp.float32)
    call = dict(kv_lengths=jnp.array([100, 128], jnp.int32), return_lse=True, num_splits=2,
                interpret=True)
    if paged:  # two pages of 64 per sequence
        k, v = k.reshape(4, 64, 2, 16), v.reshape(4, 64, 2, 16)
        call["block_table"] = jnp.arange(4, dtype=jnp.int32).reshape(2, 2)
    want = pf.decode_attention(q, k, v, window=(128, 0), **call)
    for window in ((2 ** 31, 0), (2 ** 63, 2 ** 40), (10 ** 30, None)):
        got = pf.decode_attention(q, k, v, window=window, **call)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


# ================================================================================================
# Ring attention: sinks and the zig-zag layout
# ================================================================================================


def _ring_inputs():
    q = jnp.ones((1, 16, 4, 16), jnp.float32)
    kv = jnp.ones((1, 16, 2, 16), jnp.float32)
    return q, kv, kv


@pytest.mark.parametrize("sinks,match", [
    (jnp.zeros((2,), jnp.float32), r"sinks must have shape \[q_heads\] = \(4,\), got \(2,\)"),
    (jnp.zeros((4,), jnp.int32), r"sinks must have a floating dtype, got int32"),
    ([0.0] * 4, r"sinks must be an array of shape \[q_heads\], got list"),
])
def test_ring_sinks_checked_before_the_kernels(sinks, match):
    mesh = make_mesh((2,), ("x",))
    with pytest.raises(ValueError, match=match):
        pf.ring_attention(*_ring_inputs(), mesh=mesh, axis_name="x", sinks=sinks,
                          interpret=True)

    def local(q, k, v):
        return pf.ring_attention_local(q, k, v, axis_name="x", sinks=sinks, interpret=True)

    spec = jax.sharding.PartitionSpec(None, "x")
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                           check_vma=False)
    with pytest.raises(ValueError, match=match):
        jax.jit(mapped).trace(*_ring_inputs())


def test_ring_with_valid_sinks_reaches_the_kernel():
    # The trap covers the ring's kernels, so the test above proves its checks come first.
    mesh = make_mesh((2,), ("x",))
    with pytest.raises(AssertionError, match=r"a kernel \(triton.forward\) was reached"):
        pf.ring_attention(*_ring_inputs(), mesh=mesh, axis_name="x",
                          sinks=jnp.zeros((4,), jnp.float32), interpret=True)


@pytest.mark.parametrize("fn", [pf.zigzag_permute, pf.zigzag_unpermute])
@pytest.mark.parametrize("args,kwargs,match", [
    ((jnp.zeros((2, 8)), 2), dict(axis=5), r"axis must be an int with -2 <= axis < 2 for x of "
                                           r"shape \(2, 8\), got 5"),
    ((jnp.zeros((2, 8)), 2), dict(axis=-3), r"axis must be an int with -2 <= axis < 2"),
    ((jnp.zeros((2, 8)), 2), dict(axis=1.0), r"axis must be an int .* got 1.0"),
    ((jnp.zeros((2, 8)), 2), dict(axis=True), r"axis must be an int .* got True"),
    ((jnp.zeros(()), 1), dict(axis=0), r"axis must be an int with 0 <= axis < 0"),
    ((jnp.zeros((2, 8)), 0), {}, r"num_devices must be a positive int, got 0"),
    ((jnp.zeros((2, 8)), -2), {}, r"num_devices must be a positive int, got -2"),
    ((jnp.zeros((2, 8)), True), {}, r"num_devices must be a positive int, got True"),
    ((jnp.zeros((2, 8)), 2.0), {}, r"num_devices must be a positive int, got 2.0"),
    ((jnp.zeros((2, 12)), 4), {}, r"length of axis 1 \(12\) must be divisible by 2 \* "
                                  r"num_devices \(8\)"),
    (([[0.0] * 8] * 2, 2), {}, r"x must be an array, got list"),
])
def test_zigzag_arguments(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


# ================================================================================================
# segment_ids_from_cu_seqlens
# ================================================================================================


def test_cu_seqlens_counts_must_match():
    match = (r"cu_seqlens and cu_seqlens_kv must hold the same number of sequences, got 2 and 1 "
             r"\(shapes \(3,\) and \(2,\)\)")
    with pytest.raises(ValueError, match=match):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 2, 4]), 4, jnp.array([0, 4]), 4)
    # Shapes are static: a traced pair is checked too.
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda a, b: pf.segment_ids_from_cu_seqlens(a, 4, b, 4)).trace(
            jnp.array([0, 2, 4]), jnp.array([0, 4]))


def test_wide_ids_and_lengths_must_fit_int32(x64):
    """int64 ids and lengths are checked where their values are known: one that would wrap in
    int32, or a segment id the padding reserves, is refused instead of merging documents."""
    q, k, v = qkv(shape_q=(1, 8, 2, 16), shape_kv=(1, 8, 2, 16))
    ids = jnp.zeros((1, 8), jnp.int64)
    for bad in (2**32, 2**31 - 2):
        with pytest.raises(ValueError, match=r"q_segment_ids must hold values from .* \(the "
                                             r"kernels take int32\)"):
            pf.flash_attention(q, k, v, q_segment_ids=ids.at[0, 3].set(bad), kv_segment_ids=ids)
    with pytest.raises(ValueError, match=r"kv_lengths must hold values from"):
        pf.flash_attention(q, k, v, kv_lengths=jnp.array([2**32 + 3], jnp.int64))
