"""Batch and head sharding: `flash_attention` over a `jax.sharding.Mesh`, with no collectives.

Attention never mixes batch rows or heads, so when the batch and/or the heads are split over
mesh axes every device runs the ordinary `flash_attention` on its own shard, forward and
backward. For GQA each device must hold whole groups: the q heads and the kv heads are both
split into the same number of equal contiguous runs, so q head h and its kv head h // group land
on the same device.

The mesh helpers below (axis checks, partition entries, placement) are shared with ring.py,
which splits the sequence instead. Both run shard_map with check_vma=False: the kernels'
pallas_calls do not declare how their outputs vary over mesh axes, so shard_map's varying-axes
check cannot type them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pallas_flash import attention, validation
from pallas_flash.sinks import check_sinks

__all__ = ["sharded_flash_attention"]

AxisNames = str | Sequence[str] | None
# The options that carry per-token or per-row integers, split with the batch (and, in the ring,
# along the sequence).
ID_OPTIONS = ("q_segment_ids", "kv_segment_ids", "q_lengths", "kv_lengths")


# ================================================================================================
# Mesh helpers
# ================================================================================================

def _names(axes: AxisNames) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def partition_entry(axes: AxisNames):
    """A PartitionSpec entry: None, one axis name, or a tuple of them."""
    names = _names(axes)
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def check_axes(mesh, **axes: AxisNames) -> None:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    seen: dict[str, str] = {}
    for role, value in axes.items():
        if value is not None and not (isinstance(value, str) or (
                isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value))):
            raise ValueError(f"{role} must be None, a mesh axis name or a tuple of them, "
                             f"got {value!r}")
        for name in _names(value):
            if name not in mesh.shape:
                raise ValueError(f"{role} {name!r} is not an axis of the mesh "
                                 f"(axes {tuple(mesh.axis_names)})")
            if name in seen:
                raise ValueError(f"mesh axis {name!r} is used twice: as {seen[name]} and {role}")
            seen[name] = role


def _axis_size(mesh, axes: AxisNames) -> int:
    size = 1
    for name in _names(axes):
        size *= mesh.shape[name]
    return size


def check_divisible(what: str, n: int, mesh, axes: AxisNames, role: str, why: str = "") -> None:
    parts = _axis_size(mesh, axes)
    if n % parts:
        raise ValueError(f"{what} ({n}) must be divisible by the size of {role} "
                         f"{_names(axes)} ({parts}){why}")


def check_heads(q, k, mesh, head_axis: AxisNames) -> None:
    why = (": every device must hold whole GQA groups, so the q heads and the kv heads are "
           "split into the same number of equal parts")
    check_divisible("the number of q heads", q.shape[2], mesh, head_axis, "head_axis", why)
    check_divisible("the number of kv heads", k.shape[2], mesh, head_axis, "head_axis", why)


def _is_explicit(mesh, spec: PartitionSpec) -> bool:
    names = [n for entry in spec if entry is not None for n in _names(entry)]
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return bool(names) and all(types[n] == AxisType.Explicit for n in names)


def place(mesh, x, spec: PartitionSpec):
    """Puts x in the layout shard_map expects. With Auto axes, jit's partitioner does that on
    its own (and leaves x alone when it is laid out so already); Explicit axes carry the
    sharding in the type, and shard_map insists that it matches, so we reshard (a no-op when
    it already does)."""
    if _is_explicit(mesh, spec):
        return jax.reshard(x, NamedSharding(mesh, spec))
    return x


def freeze_axes(axes: AxisNames):
    """axes in a hashable form (a list becomes a tuple), for the lru_cache keys."""
    return tuple(axes) if isinstance(axes, list) else axes


def _cached(builder, *key):
    """builder(*key), memoised when the key is hashable (so repeated calls trace once)."""
    try:
        hash(key)
    except TypeError:
        return builder.__wrapped__(*key)
    return builder(*key)


# ================================================================================================
# Batch / head sharding
# ================================================================================================

_FLASH_OPTIONS = (frozenset(inspect.signature(attention.flash_attention).parameters)
                  - {"q", "k", "v"})
_VALIDATED = ("causal", "scale", "causal_alignment", "window", "softcap") + ID_OPTIONS
_VALIDATE_DEFAULTS = {"causal": False, "scale": None, "causal_alignment": "top_left",
                      "window": None, "softcap": None}


def sharded_flash_attention(q, k, v, *, mesh: Mesh, batch_axis: AxisNames = None,
                            head_axis: AxisNames = None, **flash_options):
    """`flash_attention` with batch and/or heads split over mesh axes; no collectives.

    Args:
      q, k, v: global arrays [batch, seq, heads, head_dim], as for `flash_attention`.
      mesh: the device mesh.
      batch_axis: mesh axis name (or tuple of names) that splits the batch; None: not split.
      head_axis: mesh axis name (or tuple) that splits the heads. Both the q heads and the kv
        heads must be divisible by its size, so each device holds whole GQA groups.
      **flash_options: any other `flash_attention` argument (causal, window, segment ids,
        lengths, sinks, return_lse, config, ...). Segment ids and lengths are split over
        batch_axis with the batch, sinks over head_axis with the heads.

    Returns:
      What `flash_attention` returns, as global arrays sharded like the inputs (lse
      [batch, q_heads, seq] split over batch_axis and head_axis).

    Under `jax.jit` with inputs already laid out this way (e.g. `NamedSharding(mesh,
    P(batch_axis, None, head_axis, None))`), the compiled program has no all-gather, all-to-all
    or all-reduce for the attention, forward or backward, except with sinks and a batch_axis:
    the sinks' gradient is then summed over the batch shards (one all-reduce of q_heads
    floats). Other layouts are resharded first.
    """
    unknown = set(flash_options) - _FLASH_OPTIONS
    if unknown:
        raise TypeError(f"sharded_flash_attention got unexpected flash_attention options "
                        f"{sorted(unknown)}")
    check_axes(mesh, batch_axis=batch_axis, head_axis=head_axis)
    # Validate against the global shapes, so errors name the shapes the caller passed.
    validation.validate(q, k, v, v_head_dim_may_differ=True,
                        **{name: flash_options.get(name, _VALIDATE_DEFAULTS.get(name))
                           for name in _VALIDATED})
    check_divisible("the batch size", q.shape[0], mesh, batch_axis, "batch_axis")
    check_heads(q, k, mesh, head_axis)

    ids = {name: flash_options.pop(name) for name in ID_OPTIONS
           if flash_options.get(name) is not None}
    if flash_options.get("sinks") is not None:
        # An operand split with the heads, not a static option: each device takes its own.
        ids["sinks"] = check_sinks(flash_options.pop("sinks"), q.shape[2])
    flash_options = {name: value for name, value in flash_options.items() if value is not None}
    if isinstance(flash_options.get("window"), list):
        flash_options["window"] = tuple(flash_options["window"])
    static = tuple(sorted(flash_options.items()))
    fn = _cached(_sharded_flash_fn, mesh, freeze_axes(batch_axis), freeze_axes(head_axis), static,
                 tuple(ids))
    return fn(q, k, v, *ids.values())


@functools.lru_cache(maxsize=None)
def _sharded_flash_fn(mesh, batch_axis, head_axis, static, id_names):
    options = dict(static)
    b, h = partition_entry(batch_axis), partition_entry(head_axis)
    heads = PartitionSpec(b, None, h, None)
    id_specs = [PartitionSpec(h) if name == "sinks" else
                PartitionSpec(b, None) if name.endswith("segment_ids") else PartitionSpec(b)
                for name in id_names]
    out_specs = (heads, PartitionSpec(b, h, None)) if options.get("return_lse") else heads

    def per_device(q, k, v, *ids):
        return attention.flash_attention(q, k, v, **options, **dict(zip(id_names, ids)))

    in_specs = (heads, heads, heads, *id_specs)
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)

    def run(*args):
        return mapped(*(place(mesh, x, s) for x, s in zip(args, in_specs)))

    return jax.jit(run)

