"""A cache of the Mosaic GPU kernels' lowering: within a process, and across processes beside
JAX's compilation cache.

Lowering a Mosaic GPU kernel (tracing its jaxpr into MLIR, then Mosaic's layout inference)
takes seconds, and JAX does it again for every program that holds the kernel: a training step
and an evaluation step, or a function jitted again in a notebook, each lower the same kernels.
JAX's persistent compilation cache (`jax_compilation_cache_dir`) keys a program by its lowered
module, so a new process too lowers every kernel before that cache can answer. So this module
keeps each kernel's lowered module, keyed by everything the lowering reads: in memory for the
process (`MEMORY_ENTRIES` kernels, the least recently used dropped first; `jax.clear_caches()`
empties it), and, when JAX's compilation cache is on, in `<cache dir>/pallas_flash_lowering/`,
so a later process parses the module instead of lowering the kernel again.

What it wraps: `jax._src.pallas.mosaic_gpu.lowering.lower_unpipelined_jaxpr_to_module`, the
step that `plgpu.kernel` lowers through (every Mosaic kernel here is a `plgpu.kernel`), for
kernels named `pallas_flash*` only: other libraries' Mosaic kernels pass straight through. Its
result is kept as MLIR bytecode, source locations included, and parsed afresh for each use,
so the module handed back is the one that was lowered: the program JAX then builds is the same
text either way, and JAX's own caches (and Mosaic GPU's compiled-kernel cache, keyed by the
module's bytes) find it. Only what is cheap to carry is cached: a result with a profiler
buffer is lowered afresh every time.

The key: a SHA-256 of the kernel's jaxpr as JAX prints it (every equation with its
parameters, shapes and dtypes), the operand and result types, the kernel mesh and compiler
parameters, the SPMD mesh, the jax and jaxlib versions and every `MOSAIC_GPU*` environment
variable. A kernel whose jaxpr or parameters print an object by identity (`at 0x...`), which
does not pin the object down, is not cached at all.

Off when `PALLAS_FLASH_LOWERING_CACHE=0`, or when the installed jax lacks the wrapped function
(the kernels then lower as usual); the files are off when JAX's compilation cache is off or
remote (a URL). A cache file that cannot be read or parsed is ignored and rewritten.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import os
import re
import tempfile
import threading

import jax
import jaxlib
import numpy as np

__all__ = ["install", "directory", "cache_key", "clear", "ENV_SWITCH", "MEMORY_ENTRIES"]

ENV_SWITCH = "PALLAS_FLASH_LOWERING_CACHE"
# Every Mosaic kernel of this package is named so (its KERNEL_NAME constants).
KERNEL_PREFIX = "pallas_flash"
_SUBDIR = "pallas_flash_lowering"
_FORMAT = "1"
# Kernels kept in memory: a program holds a few (a forward, a backward), a process rarely more
# than a few dozen shapes and option sets; an entry is the module's bytecode, 0.2-0.5 MB.
MEMORY_ENTRIES = 64
_installed = False


class _Memory:
    """key -> (bytecode, metadata) of this process's lowerings, least recently used first.
    Registered with JAX's cache management, so that `jax.clear_caches()` empties it."""

    def __init__(self):
        self.entries: collections.OrderedDict[str, tuple[bytes, dict]] = (
            collections.OrderedDict())
        # Programs may be lowered on several threads at once.
        self.lock = threading.Lock()

    def get(self, key: str):
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
            return entry

    def put(self, key: str, entry: tuple[bytes, dict]) -> None:
        with self.lock:
            self.entries[key] = entry
            self.entries.move_to_end(key)
            while len(self.entries) > MEMORY_ENTRIES:
                self.entries.popitem(last=False)

    # The interface JAX's cache registry expects (jax._src.util.register_cache).
    def cache_clear(self) -> None:
        with self.lock:
            self.entries.clear()

    def cache_info(self) -> str:
        return f"{len(self.entries)} of {MEMORY_ENTRIES} kernels"

    def cache_keys(self) -> list[str]:
        with self.lock:
            return list(self.entries)


_MEMORY = _Memory()


def clear() -> None:
    """Forget this process's lowerings (the files stay): as `jax.clear_caches()` does."""
    _MEMORY.cache_clear()


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def directory() -> str | None:
    """The cache folder, or None when the files are off."""
    if not enabled():
        return None
    base = jax.config.jax_compilation_cache_dir
    # A remote cache (gs://, s3://, ...) is JAX's to reach; this module writes local files only.
    if not base or "://" in str(base):
        return None
    return os.path.join(os.path.expanduser(str(base)), _SUBDIR)


def cache_key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params) -> str | None:
    """SHA-256 hex of everything the wrapped lowering reads (module docstring), or None when
    what it reads prints an object by identity."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MOSAIC_GPU"))
    parts = [
        _FORMAT, jax.__version__, jaxlib.__version__, repr(gpu_mesh), repr(jax_mesh),
        repr(params), repr([str(a) for a in in_shapes]), repr([str(a) for a in out_shapes]),
        repr(env), str(jaxpr),
    ]
    if any(_IDENTITY.search(part) for part in parts):
        return None
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


# How Python prints an object that has no printed value: its type and address.
_IDENTITY = re.compile(r" at 0x[0-9a-fA-F]+")


def _shapes(structs) -> list:
    return [[list(s.shape), str(s.dtype)] for s in structs]


def _structs(items) -> tuple:
    return tuple(jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for shape, dtype in items)


def _pack(result) -> tuple[bytes, dict]:
    """A lowering as (bytecode, metadata): what the memory and the files keep."""
    meta = {"grid": list(result.grid), "block": list(result.block),
            "new_out_shapes": _shapes(result.new_out_shapes),
            "gmem_scratch_shapes": _shapes(result.gmem_scratch_shapes)}
    buffer = io.BytesIO()
    result.module.operation.write_bytecode(buffer)
    return buffer.getvalue(), meta


def _unpack(bytecode: bytes, meta: dict):
    """A fresh LoweringResult parsed from `_pack`'s output, or None if it does not parse."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.mosaic_gpu.lowering import LoweringResult
    try:
        module = ir.Module.parse(bytecode)
        return LoweringResult(module=module, grid=tuple(meta["grid"]),
                              block=tuple(meta["block"]),
                              new_out_shapes=_structs(meta["new_out_shapes"]), profiler_spec=None,
                              gmem_scratch_shapes=_structs(meta["gmem_scratch_shapes"]))
    except Exception:  # noqa: BLE001 - unparsable: lower afresh
        return None


def _read(path: str) -> tuple[bytes, dict] | None:
    try:
        with open(path + ".json") as f:
            meta = json.load(f)
        with open(path + ".mlirbc", "rb") as f:
            return f.read(), meta
    except (OSError, ValueError):   # absent, partly written or not JSON: lower afresh
        return None


def _write(path: str, bytecode: bytes, meta: dict) -> None:
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        # Each file is written whole under a temporary name, then renamed: a concurrent
        # reader sees the old file, the new one, or none, never half of one. The module goes
        # last, so a reader that finds it finds its metadata too.
        for suffix, data in ((".json", json.dumps(meta).encode()), (".mlirbc", bytecode)):
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)   # as readable as JAX's own cache files, not mkstemp's 0600
            os.replace(tmp, path + suffix)
    except OSError:
        pass   # a read-only or full cache folder costs the next process a lowering, no more


def _cached(lower):
    def lower_with_cache(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs):
        # Only this library's kernels: other Mosaic GPU kernels in the process lower as JAX
        # lowers them.
        ours = str(getattr(gpu_mesh, "kernel_name", None) or "").startswith(KERNEL_PREFIX)
        key = (cache_key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params)
               if ours and enabled() else None)
        if key is None:
            return lower(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs)
        folder = directory()
        path = None if folder is None else os.path.join(folder, key)
        for entry in (_MEMORY.get(key), None if path is None else _read(path)):
            hit = None if entry is None else _unpack(*entry)
            if hit is not None:
                _MEMORY.put(key, entry)
                return hit
        result = lower(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs)
        if result.profiler_spec is None:
            entry = _pack(result)
            _MEMORY.put(key, entry)
            if path is not None:
                _write(path, *entry)
        return result

    lower_with_cache.__wrapped__ = lower
    return lower_with_cache


def install() -> bool:
    """Wrap the Mosaic GPU lowering once per process; False if this jax has no such step."""
    global _installed
    if _installed:
        return True
    try:
        from jax._src.pallas.mosaic_gpu import lowering
        lower = lowering.lower_unpipelined_jaxpr_to_module
        fields = {f.name for f in dataclasses.fields(lowering.LoweringResult)}
    except (ImportError, AttributeError, TypeError):
        return False
    if fields != {"module", "grid", "block", "new_out_shapes", "profiler_spec",
                  "gmem_scratch_shapes"}:
        return False   # a LoweringResult this module cannot rebuild: leave the lowering alone
    lowering.lower_unpipelined_jaxpr_to_module = _cached(lower)
    try:
        from jax._src import util
        util.register_cache(_MEMORY, "pallas_flash Mosaic kernel lowerings")
    except (ImportError, AttributeError):
        pass   # jax.clear_caches() then leaves it; lowering_cache.clear() still empties it
    _installed = True
    return True
