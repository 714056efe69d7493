"""pallas_flash/mosaic/lowering_cache.py: a Mosaic kernel is lowered once per process, and,
with JAX's compilation cache on, written once and read back by later processes; the program is
the same text either way (so JAX's own cache and Mosaic GPU's kernel cache find it). Lowered
for sm_90 on any machine, as in test_lowering.py; `_lower` clears every cache of the process
(jax.clear_caches), as a new process starts."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, ON_GPU
from pallas_flash import attention
from pallas_flash.mosaic import lowering_cache

pytest.importorskip("jax.experimental.mosaic.gpu")
pytestmark = pytest.mark.skipif(ON_GPU and not IS_HOPPER,
                                reason="Mosaic GPU lowers for the GPU present: sm_90 only")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """JAX's compilation cache pointed at a fresh folder for the test, then restored."""
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(attention, "_capability", lambda: "9.0")
    monkeypatch.delenv(lowering_cache.ENV_SWITCH, raising=False)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path / "pallas_flash_lowering"
    jax.config.update("jax_compilation_cache_dir", before)
    jax.clear_caches()


def _lower(causal=True, seq=512, fresh=True):
    """The program text of a jitted forward+backward step, lowered for sm_90; `fresh`: after
    clearing the process's caches, as in a new process."""
    if fresh:
        jax.clear_caches()
    x = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)

    def step(q, k, v, do):   # a new function each call: JAX's own caches cannot answer
        def attend(q, k, v):
            return pf.flash_attention(q, k, v, causal=causal, backend="mosaic", interpret=False)
        return jax.vjp(attend, q, k, v)[1](do)

    return jax.jit(step).trace(x, x, x, x).lower(lowering_platforms=("cuda",)).as_text()


def _entries(folder):
    return sorted(p for p in os.listdir(folder) if p.endswith(".mlirbc")) if folder.exists() else []


def _forbid_lowering(monkeypatch):
    """From here on, a kernel that is not read from the cache fails to lower."""
    from jax._src.pallas.mosaic_gpu import lowering

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was lowered instead of read from the cache")
    monkeypatch.setattr(lowering, "lower_jaxpr_to_module", refuse)


def test_installed():
    from jax._src.pallas.mosaic_gpu import lowering
    assert lowering_cache.install()
    assert hasattr(lowering.lower_unpipelined_jaxpr_to_module, "__wrapped__")


def test_read_back_gives_the_same_program(cache_dir, monkeypatch):
    first = _lower()
    entries = _entries(cache_dir)
    assert len(entries) == 2   # the forward and the fused backward
    _forbid_lowering(monkeypatch)
    assert _lower() == first
    assert _entries(cache_dir) == entries


def test_other_kernels_get_other_entries(cache_dir):
    _lower(causal=True)
    causal = set(_entries(cache_dir))
    _lower(causal=False)
    both = set(_entries(cache_dir))
    assert len(both) == 2 * len(causal)
    _lower(causal=True, seq=1024)   # the grid changes with the length
    assert len(set(_entries(cache_dir))) > len(both)


def test_unreadable_entry_is_lowered_again(cache_dir, monkeypatch):
    _lower()
    entries = _entries(cache_dir)
    for name in entries:
        (cache_dir / name).write_bytes(b"not MLIR bytecode")
    again = _lower()
    assert _entries(cache_dir) == entries
    # Rewritten whole: the next lowering reads it back.
    _forbid_lowering(monkeypatch)
    assert _lower() == again


def test_other_kernels_pass_through(cache_dir):
    # A Mosaic GPU kernel of another library is lowered as JAX lowers it, never cached.
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    add_one = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                           kernel_name="someone_elses_kernel")
    x = jax.ShapeDtypeStruct((128,), jnp.float32)
    jax.jit(add_one).trace(x).lower(lowering_platforms=("cuda",))
    assert _entries(cache_dir) == []


def test_off_without_compilation_cache_or_when_switched_off(cache_dir, monkeypatch):
    monkeypatch.setenv(lowering_cache.ENV_SWITCH, "0")
    _lower()
    assert _entries(cache_dir) == []
    monkeypatch.delenv(lowering_cache.ENV_SWITCH)
    jax.config.update("jax_compilation_cache_dir", "gs://a-bucket/jax-cache")
    assert lowering_cache.directory() is None   # remote: JAX's own cache only
    jax.config.update("jax_compilation_cache_dir", None)
    assert lowering_cache.directory() is None
    _lower()
    assert not cache_dir.exists()


@pytest.fixture
def no_cache_dir(monkeypatch):
    """Hopper lowering with JAX's compilation cache off: the in-process layer alone."""
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(attention, "_capability", lambda: "9.0")
    monkeypatch.delenv(lowering_cache.ENV_SWITCH, raising=False)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    jax.clear_caches()


def _count_lowerings(monkeypatch) -> list:
    """Calls of the lowering below the cache, appended to the returned list."""
    from jax._src.pallas.mosaic_gpu import lowering
    calls, inner = [], lowering.lower_jaxpr_to_module

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)
    monkeypatch.setattr(lowering, "lower_jaxpr_to_module", counted)
    return calls


def test_a_process_lowers_each_kernel_once(no_cache_dir, monkeypatch):
    """A second program with the same kernels (an evaluation step, a function jitted again)
    reuses their lowering without the compilation cache, and gets the same program text:
    lowered afresh, the kernels' modules and hashes differ, so Mosaic GPU compiles them again."""
    calls = _count_lowerings(monkeypatch)
    first = _lower()
    assert len(calls) == 2                       # the forward and the fused backward
    assert _lower(fresh=False) == first
    assert len(calls) == 2
    _lower(causal=False, fresh=False)            # other kernels: lowered
    assert len(calls) == 4
    jax.clear_caches()                           # empties this cache too
    _lower(fresh=False)
    assert len(calls) == 6


def test_switched_off_lowers_every_time(no_cache_dir, monkeypatch):
    monkeypatch.setenv(lowering_cache.ENV_SWITCH, "0")
    calls = _count_lowerings(monkeypatch)
    _lower()
    _lower(fresh=False)
    assert len(calls) == 4


def test_memory_keeps_the_most_recently_used(monkeypatch):
    monkeypatch.setattr(lowering_cache, "MEMORY_ENTRIES", 2)
    memory = lowering_cache._Memory()
    for key in "abc":
        memory.put(key, (key.encode(), {}))
    assert memory.cache_keys() == ["b", "c"]
    assert memory.get("b") == (b"b", {})         # used: now the most recent
    memory.put("d", (b"d", {}))
    assert memory.cache_keys() == ["b", "d"]
    memory.cache_clear()
    assert memory.cache_keys() == []


def test_an_object_printed_by_identity_is_not_cached():
    """Its printed address can be another object's later, so it keys nothing."""
    class Opaque:
        pass
    key = lowering_cache.cache_key("mesh", None, "{ lambda ; a:f32[8]. let  in (a,) }", (), (),
                                   {"callback": Opaque()})
    assert key is None
    assert lowering_cache.cache_key("mesh", None, "{ lambda ; a:f32[8]. let  in (a,) }", (), (),
                                    {"block": 64}) is not None
