"""The backends the feature matrix (test_features.py) runs, each with what it supports.

A backend is a family of kernels ("triton" or "mosaic", each a forward(spec, ...) -> (O, stats)
and a backward(spec, ..., stats, dO, dlse) -> (dq, dk, dv)) plus capability flags. The matrix
pairs every case with every backend that declares it supported; test_features.py checks that
the Mosaic kernels' own `unsupported_reason` agrees with the flags, so they cannot drift.

A config variant is a backend of the Mosaic family that replaces a few fields of the tiles a
case runs at (three compute warpgroups, clusters, 176-key blocks, the unfused exponent). It runs
the case groups it names, not the whole matrix.

Interpret mode simulates every Mosaic warpgroup and barrier on the CPU, seconds per call, and
the CPU suite has a time budget: each Mosaic backend names the groups or cases it runs there;
the rest run compiled only (on an sm_90 GPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic.common import SUPPORTED_HEAD_DIMS
from pallas_flash.mosaic.config import default_backward_config, default_forward_config
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward

ON_GPU = jax.default_backend() == "gpu"
IS_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"

BOTH = frozenset({"forward", "backward"})
HALF = frozenset({jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)})


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to run a case, and what it supports.

    family: "triton" or "mosaic": which kernels, and which of a case's tiles they read.
    dtypes, head_dims (None: any), softcap, window, segments: what the kernels serve.
    needs_sm90: compiled only on Hopper (elsewhere on a GPU the case is skipped).
    passes: the passes it tests; a forward-only variant leaves the backward to the base.
    groups: the case groups a variant runs (None: every case but `skips`).
    skips: case groups that exist for variants (their tiles), not for this backend.
    forward_fields / backward_fields: config fields replaced on top of the case's tiles.
    interpret: groups or case keys ("group/name[-tiles]") it runs in interpret mode
      (None: all).
    """

    name: str
    family: str
    dtypes: frozenset
    head_dims: frozenset | None = None
    softcap: bool = True
    window: bool = True
    segments: bool = True
    needs_sm90: bool = False
    passes: frozenset = BOTH
    groups: frozenset | None = None
    skips: frozenset = frozenset()
    forward_fields: tuple = ()
    backward_fields: tuple = ()
    interpret: frozenset | None = None

    def supports(self, case) -> bool:
        """What the flags allow: dtype, head_dim, options, the case's group and passes."""
        opts = case.options
        return (jnp.dtype(case.dtype) in self.dtypes
                and (self.head_dims is None or case.shape[-1] in self.head_dims)
                and (self.softcap or opts.get("softcap") is None)
                and (self.window or opts.get("window") is None)
                and (self.segments or case.ids is None)
                and (self.groups is None or case.group in self.groups)
                and case.group not in self.skips
                and bool(self.passes & case.passes))

    def tiles(self, case) -> dict:
        """{label: (forward config, backward config)} this backend runs the case at: the case's
        tiles with this variant's fields replaced, configs that fail validation left out, and
        labels that end at the same configs as an earlier one dropped."""
        if self.family == "triton":
            return {"": (None, None)}     # Triton's tiles come with the spec
        d = case.shape[-1]
        forward, backward = case.forward_tiles, case.backward_tiles
        pairs = {}
        for label in dict.fromkeys([*forward, *backward]) or [""]:
            fwd = forward.get(label, forward.get(""))
            bwd = backward.get(label, backward.get(""))
            try:
                if self.forward_fields:
                    fwd = dataclasses.replace(fwd or default_forward_config(d),
                                              **dict(self.forward_fields))
                if self.backward_fields:
                    bwd = dataclasses.replace(bwd or default_backward_config(d),
                                              **dict(self.backward_fields))
            except ValueError:            # the variant cannot take these tiles
                continue
            if (fwd, bwd) not in pairs.values():
                pairs[label] = (fwd, bwd)
        return pairs

    def runs_interpreted(self, case, label) -> bool:
        key = case.key(label)
        return self.interpret is None or case.group in self.interpret or key in self.interpret

    def forward(self, spec, q, k, v, q_ids, kv_ids, config):
        if self.family == "triton":
            return triton_forward.forward(spec, q, k, v, q_ids, kv_ids)
        return mosaic_forward.forward(spec, q, k, v, q_ids, kv_ids, config=config)

    def backward(self, spec, q, k, v, out, stats, do, dlse, q_ids, kv_ids, config):
        if self.family == "triton":
            return triton_backward.backward(spec, q, k, v, out, stats, do, dlse, q_ids, kv_ids)
        return mosaic_backward.backward(spec, q, k, v, out, stats, do, dlse, q_ids, kv_ids,
                                        config=config)

    def unsupported_reason(self, spec, q, k, v, passes, forward_config, backward_config):
        """The kernels' own reason not to serve the call (None for Triton, which serves all)."""
        if self.family == "triton":
            return None
        reasons = []
        if "forward" in passes:
            reasons.append(mosaic_forward.unsupported_reason(spec, q, k, v, forward_config))
        if "backward" in passes:
            reasons.append(mosaic_backward.unsupported_reason(spec, q, k, v, backward_config))
        return next((r for r in reasons if r is not None), None)

    def marks(self, case, label) -> list:
        """Skips: Mosaic off Hopper, and what runs compiled only when there is no GPU."""
        if self.needs_sm90 and ON_GPU and not IS_HOPPER:
            return [pytest.mark.skip(reason="the Mosaic GPU kernels need sm_90")]
        if not ON_GPU and not (case.interpret and self.runs_interpreted(case, label)):
            return [pytest.mark.skip(reason="compiled only (interpret mode is slow, and the CPU "
                                     "suite has a time budget)")]
        return []


TRITON = Backend("triton", "triton",
                 dtypes=HALF | {jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)})

MOSAIC = Backend(
    "mosaic", "mosaic", dtypes=HALF, head_dims=frozenset(SUPPORTED_HEAD_DIMS), needs_sm90=True,
    # The three-warpgroup and cluster cases are for those variants (VARIANTS below): at the
    # default tiles they would repeat other cases under a name that promises what they skip.
    skips=frozenset({"three-wgs", "clusters"}),
    interpret=frozenset({"forward", "features", "key-blocks", "launch-order", "backward",
                         "launch-order-bwd", "fused", "paired", "defaults", "head-dims"}))


def _variant(name, fields, *, groups, interpret=(), head_dims=frozenset({64, 128, 256})):
    return dataclasses.replace(MOSAIC, name=name, passes=frozenset({"forward"}),
                               groups=frozenset(groups), skips=frozenset(),
                               forward_fields=tuple(fields.items()),
                               interpret=frozenset(interpret), head_dims=head_dims)


# 192 query rows per CTA, FlashAttention-3's head_dim 64 tile; registers allow it only there.
THREE_WGS = dict(compute_wgs=3, pingpong=False, compute_registers=160, copy_registers=32)
# The 128 x 176 tile of FlashAttention-3 at head_dim 128: V takes a narrower swizzle.
KEY176 = dict(block_kv=176, pingpong=False, overlap=True, compute_registers=240,
              copy_registers=24)

VARIANTS = [
    _variant("mosaic-3wgs", THREE_WGS, groups=("features", "three-wgs"),
             head_dims=frozenset({64}),
             interpret=("features/partial-tiles", "features/window-causal-softcap",
                        "features/segments-lengths", "three-wgs")),
    # Clusters share each K / V block by TMA multicast; the interpreter does not model it.
    _variant("mosaic-cluster2", dict(cluster=2), groups=("features", "clusters")),
    _variant("mosaic-cluster4", dict(cluster=4), groups=("features", "clusters")),
    _variant("mosaic-key176", dict(block_kv=176), groups=("features",)),
    _variant("mosaic-unfused-exp", dict(fused_exponent=False), groups=("features",),
             interpret=("features/softcap-full-mqa", "features/window-causal-softcap")),
    # The persistent forward (schedule.persistent_forward_plan): a CTA per SM, and three CTAs
    # running every item of a case in turn.
    _variant("mosaic-persistent-fwd", dict(persistent=True, cluster=1),
             groups=("features", "launch-order"),
             interpret=("features/partial-tiles", "features/segments-lengths")),
    _variant("mosaic-persistent-fwd-3ctas", dict(persistent=True, cluster=1, ctas=3),
             groups=("features",), interpret=("features/window-causal-softcap",)),
    # The next item's Q loaded while this one runs: three CTAs, so that every CTA loads ahead.
    _variant("mosaic-persistent-fwd-prefetch",
             dict(persistent=True, cluster=1, ctas=3, q_prefetch=True),
             groups=("features", "launch-order"),
             interpret=("features/partial-tiles", "features/segments-lengths",
                        "launch-order/segments-gqa-chunk2")),
]


def _backward_variant(name, fields, *, groups, interpret=()):
    return dataclasses.replace(MOSAIC, name=name, passes=frozenset({"backward"}),
                               groups=frozenset(groups), skips=frozenset(),
                               backward_fields=tuple(fields.items()),
                               interpret=frozenset(interpret), head_dims=frozenset({64, 128}))


# The persistent fused backward (schedule.persistent_plan): a CTA per SM; then grids chosen
# against the deadlock argument: one CTA running every item in turn, and three CTAs with more
# items than CTAs, the first items handed to the CTA that launches last.
PERSISTENT = dict(fused_persistent=True)
BACKWARD_VARIANTS = [
    _backward_variant("mosaic-persistent", PERSISTENT, groups=("fused",),
                      interpret=("fused/causal-gqa",)),
    _backward_variant("mosaic-persistent-1cta", dict(PERSISTENT, fused_ctas=1),
                      groups=("fused",), interpret=("fused/partial-bottom-right-mqa",)),
    _backward_variant("mosaic-persistent-3ctas-reversed",
                      dict(PERSISTENT, fused_ctas=3, fused_handout="reversed"),
                      groups=("fused",), interpret=("fused/window-softcap-d64-f16",)),
]

BACKENDS = [TRITON, MOSAIC, *VARIANTS, *BACKWARD_VARIANTS]
