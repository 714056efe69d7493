"""A cross-process cache of the Mosaic GPU kernels' lowering, beside JAX's compilation cache.

JAX's persistent compilation cache (`jax_compilation_cache_dir`) keys a program by its lowered
module, so a new process still lowers every kernel before the cache can answer, and lowering
a Mosaic GPU kernel (tracing its jaxpr into MLIR, then Mosaic's layout inference) takes
seconds: most of a warm-cache start. When that cache is on, this module keeps each kernel's
lowered Mosaic module in `<cache dir>/pallas_flash_lowering/`, keyed by everything the
lowering reads, so a later process parses the module instead of lowering the kernel again.

What it wraps: `jax._src.pallas.mosaic_gpu.lowering.lower_unpipelined_jaxpr_to_module`, the
step that `plgpu.kernel` lowers through (every Mosaic kernel here is a `plgpu.kernel`), for
kernels named `pallas_flash*` only: other libraries' Mosaic kernels pass straight through. Its
result is stored as MLIR bytecode, source locations included, so the module that is read
back is the one that was lowered: the program JAX then builds is the same text in both
processes, and JAX's own cache finds it. Only what is cheap to carry is cached: a result with
a profiler buffer is lowered afresh every time.

The key: a SHA-256 of the kernel's jaxpr as JAX prints it (every equation with its
parameters, shapes and dtypes), the operand and result types, the kernel mesh and compiler
parameters, the SPMD mesh, the jax and jaxlib versions and every `MOSAIC_GPU*` environment
variable. A jaxpr whose printed form does not pin it down (a parameter printed by identity,
not value) only misses the cache, since the identity differs between processes.

Off when JAX's compilation cache is off or remote (a URL), when `PALLAS_FLASH_LOWERING_CACHE=0`,
or when the installed jax lacks the wrapped function (the kernels then lower as usual). A cache file that
cannot be read or parsed is ignored and rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tempfile

import jax
import jaxlib
import numpy as np

__all__ = ["install", "directory", "cache_key", "ENV_SWITCH"]

ENV_SWITCH = "PALLAS_FLASH_LOWERING_CACHE"
# Every Mosaic kernel of this package is named so (its KERNEL_NAME constants).
KERNEL_PREFIX = "pallas_flash"
_SUBDIR = "pallas_flash_lowering"
_FORMAT = "1"
_installed = False


def directory() -> str | None:
    """The cache folder, or None when caching is off."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    base = jax.config.jax_compilation_cache_dir
    # A remote cache (gs://, s3://, ...) is JAX's to reach; this module writes local files only.
    if not base or "://" in str(base):
        return None
    return os.path.join(os.path.expanduser(str(base)), _SUBDIR)


def cache_key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params) -> str:
    """SHA-256 hex of everything the wrapped lowering reads (module docstring)."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MOSAIC_GPU"))
    parts = [
        _FORMAT, jax.__version__, jaxlib.__version__, repr(gpu_mesh), repr(jax_mesh),
        repr(params), repr([str(a) for a in in_shapes]), repr([str(a) for a in out_shapes]),
        repr(env), str(jaxpr),
    ]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _shapes(structs) -> list:
    return [[list(s.shape), str(s.dtype)] for s in structs]


def _structs(items) -> tuple:
    return tuple(jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for shape, dtype in items)


def _read(path: str):
    from jax._src.lib.mlir import ir
    from jax._src.pallas.mosaic_gpu.lowering import LoweringResult
    try:
        with open(path + ".json") as f:
            meta = json.load(f)
        with open(path + ".mlirbc", "rb") as f:
            module = ir.Module.parse(f.read())
    except Exception:  # noqa: BLE001 - absent, partly written or unparsable: lower afresh
        return None
    return LoweringResult(module=module, grid=tuple(meta["grid"]), block=tuple(meta["block"]),
                          new_out_shapes=_structs(meta["new_out_shapes"]), profiler_spec=None,
                          gmem_scratch_shapes=_structs(meta["gmem_scratch_shapes"]))


def _write(path: str, result) -> None:
    meta = {"grid": list(result.grid), "block": list(result.block),
            "new_out_shapes": _shapes(result.new_out_shapes),
            "gmem_scratch_shapes": _shapes(result.gmem_scratch_shapes)}
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        # Each file is written whole under a temporary name, then renamed: a concurrent
        # reader sees the old file, the new one, or none, never half of one. The module goes
        # last, so a reader that finds it finds its metadata too.
        for suffix, data in ((".json", json.dumps(meta).encode()),
                             (".mlirbc", _bytecode(result.module))):
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)   # as readable as JAX's own cache files, not mkstemp's 0600
            os.replace(tmp, path + suffix)
    except OSError:
        pass   # a read-only or full cache folder costs the next process a lowering, no more


def _bytecode(module) -> bytes:
    buffer = io.BytesIO()
    module.operation.write_bytecode(buffer)
    return buffer.getvalue()


def _cached(lower):
    def lower_with_cache(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs):
        folder = directory()
        # Only this library's kernels: other Mosaic GPU kernels in the process lower as JAX
        # lowers them.
        ours = str(getattr(gpu_mesh, "kernel_name", None) or "").startswith(KERNEL_PREFIX)
        if folder is None or not ours:
            return lower(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs)
        path = os.path.join(folder, cache_key(gpu_mesh, jax_mesh, jaxpr, in_shapes,
                                              out_shapes, params))
        hit = _read(path) if os.path.exists(path + ".mlirbc") else None
        if hit is not None:
            return hit
        result = lower(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs)
        if result.profiler_spec is None:
            _write(path, result)
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
    _installed = True
    return True
