"""The Mosaic tile configs (pallas_flash/mosaic/config.py): validation, budgets and defaults.

Every check here runs in Python, before any launch, so it holds on any machine.
"""

import jax.numpy as jnp
import pytest

from backends import THREE_WGS
from helpers import make_spec
from pallas_flash.mosaic.config import (SMEM_LIMIT, MosaicBackwardConfig, MosaicForwardConfig,
                                        default_backward_config, default_forward_config,
                                        register_budget)

C = MosaicForwardConfig
B = MosaicBackwardConfig


@pytest.mark.parametrize("fields,match", [
    (dict(block_q=128), "block_q"),
    (dict(block_kv=100), "block_kv"),
    (dict(block_kv=48), "block_kv"),
    (dict(block_kv=272), "block_kv"),
    (dict(block_kv=176, cluster=4), "cluster"),     # 44-row slices: not whole 8-row tiles
    (dict(stages=1), "stages"),
    (dict(cluster=3), "cluster"),
    (dict(cluster=8), "cluster"),
    (dict(cluster=0), "cluster"),
    (dict(compute_wgs=4, pingpong=False, compute_registers=120, copy_registers=24),
     "compute_wgs"),
    (dict(compute_wgs=3, compute_registers=160, copy_registers=32), "compute_wgs"),  # ping-pong
    # 3 * 232 + 40 and 3 * 168 + 32: past the 512 registers per thread of four warpgroups.
    (dict(compute_wgs=3, pingpong=False), "compute_registers"),
    (dict(compute_wgs=3, pingpong=False, compute_registers=168, copy_registers=32),
     "compute_registers"),
    (dict(compute_registers=240, copy_registers=40), "compute_registers"),
    # 2 * 240 + 32 = 512: within the register file, but past the 3 * 168 = 504 per thread a
    # launch of three warpgroups hands out (the GPU hangs).
    (dict(compute_registers=240, copy_registers=32), "compute_registers"),
])
def test_forward_config_validation(fields, match):
    with pytest.raises(ValueError, match=rf"MosaicForwardConfig\.{match} must be"):
        C(**fields)


@pytest.mark.parametrize("block_kv", [64, 128, 160, 192, 256])
def test_forward_config_accepts_cluster_4(block_kv):
    # Multiples of 32 split into 4 multicast slices of whole 8-row tiles (16 rows or more).
    assert C(block_kv=block_kv, cluster=4).cluster == 4


def test_q_prefetch_config():
    """A second Q tile per compute warpgroup, only where a CTA runs more than one item."""
    with pytest.raises(ValueError, match=r"MosaicForwardConfig\.q_prefetch needs persistent"):
        C(q_prefetch=True)
    cfg = C(persistent=True, q_prefetch=True)
    assert cfg.smem_bytes(128) - C(persistent=True).smem_bytes(128) == 128 * 128 * 2


def test_head_chunk_validation():
    for bad in (0, True):
        with pytest.raises(ValueError, match=r"MosaicForwardConfig\.head_chunk must be"):
            C(head_chunk=bad)
    with pytest.raises(ValueError, match=r"MosaicForwardConfig\.head_chunk must be None or 1"):
        C(cluster=2, head_chunk=2)
    C(cluster=2, head_chunk=1)
    with pytest.raises(ValueError, match=r"MosaicBackwardConfig\.head_chunk must be"):
        B(head_chunk=0)
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="fused_head_chunk"):
            B(fused_head_chunk=bad)


def test_register_budget():
    # A launch of three warpgroups gives each thread 168 registers (504 / thread summed), of
    # four 128 (512): setmaxnreg can only redistribute those.
    assert register_budget(3) == 504 and register_budget(4) == 512
    C(compute_registers=240, copy_registers=24)
    C(compute_wgs=3, pingpong=False, compute_registers=160, copy_registers=32)


@pytest.mark.parametrize("fields,match", [
    (dict(compute_registers=233), "compute_registers must be a multiple of 8"),
    (dict(copy_registers=16), "copy_registers must be a multiple of 8"),
    (dict(compute_registers=264, copy_registers=24), "compute_registers must be a multiple"),
    # 2 * 248 + 40 = 536: past the 504 a launch of three warpgroups hands out (a hang).
    (dict(compute_registers=248), "compute_registers must be at most 232"),
    # 2 * 240 + 24 = 504 fits the two kernels, but leaves the fused kernel's copy and writer
    # warpgroups (512 - 480) / 2 = 16 each, under setmaxnreg's 24.
    (dict(compute_registers=240, copy_registers=24, fused=True),
     "compute_registers must be at most 232 with fused=True"),
])
def test_backward_config_register_validation(fields, match):
    with pytest.raises(ValueError, match=rf"MosaicBackwardConfig\.{match}"):
        B(**fields)
    B(**{**fields, "compute_registers": 232, "copy_registers": 40})


@pytest.mark.parametrize("fields", [dict(compute_registers=236), dict(copy_registers=8)])
def test_forward_config_registers_are_setmaxnreg_values(fields):
    with pytest.raises(ValueError, match="setmaxnreg's range"):
        C(**fields)


def test_three_wgs_config():
    cfg = C(**THREE_WGS)
    assert cfg.cta_rows == 192 and C().cta_rows == 128
    # One more 64-row Q tile and its statistics in shared memory.
    assert cfg.smem_bytes(64) - C().smem_bytes(64) == 64 * 64 * 2 + 2 * 64 * 4
    # Three by default only for compiled head_dim 64 calls (docs/tuning.md).
    for d in (64, 128, 256):
        for causal in (False, True):
            compiled = default_forward_config(d, make_spec(256, 256, d, jnp.bfloat16,
                                                           causal=causal, interpret=False))
            assert compiled.compute_wgs == (3 if d == 64 else 2)
        for spec in (None, make_spec(256, 256, d, jnp.bfloat16, interpret=True)):
            assert default_forward_config(d, spec).compute_wgs == 2


@pytest.mark.parametrize("d,causal,has_segments,interpret,expected", [
    (128, False, False, False, 2),
    (128, True, False, False, 1),     # causal: slower in clusters (docs/tuning.md)
    (128, False, True, False, 1),     # segment ids: tiles stream different ranges
    (128, False, False, True, 1),     # the interpreter has no clusters
    (64, False, False, False, 1),
    (256, False, False, False, 1),    # slower in clusters
])
def test_default_cluster(d, causal, has_segments, interpret, expected):
    # Past PERSISTENT_FORWARD_MAX_KV keys, where the grid launches a CTA per tile.
    spec = make_spec(2048, 2048, d, jnp.bfloat16, causal=causal, has_segments=has_segments,
                     interpret=interpret)
    assert default_forward_config(d, spec).cluster == expected
    assert default_forward_config(d).cluster == 1


@pytest.mark.parametrize("d,causal,expected", [
    (80, False, (128, 2, 2)), (96, False, (192, 2, 2)),    # every tile streams every key
    (80, True, (128, 2, 1)), (96, True, (128, 2, 1)),
    (112, False, (128, 3, 2)), (112, True, (128, 3, 1)),   # a third slot fits at 112
    (128, False, (128, 2, 2)), (128, True, (128, 2, 1)),
    (144, False, (128, 2, 1)), (160, True, (128, 2, 1)), (176, False, (128, 2, 1)),
    (192, False, (64, 2, 1)), (208, True, (64, 3, 1)),     # a third slot fits at 208
    (224, False, (64, 2, 1)), (240, True, (64, 2, 1)), (256, False, (64, 2, 1)),
])
def test_default_forward_tiles_between_tuned_head_dims(d, causal, expected):
    """(block_kv, stages, cluster) of a compiled call past the persistent forward's key
    length (docs/tuning.md has the sweep behind each), and every tile fits shared memory."""
    spec = make_spec(2048, 2048, d, jnp.bfloat16, causal=causal, interpret=False)
    cfg = default_forward_config(d, spec)
    assert (cfg.block_kv, cfg.stages, cfg.cluster) == expected
    assert cfg.smem_bytes(d) <= SMEM_LIMIT


@pytest.mark.parametrize("d,sq,skv,opts,expected", [
    (128, 1024, 1024, {}, True),
    (128, 4096, 1000, {}, True),                      # the key length decides
    (128, 1024, 1025, {}, False),
    (128, 1024, 1024, dict(causal=True), False),      # a causal bound: the grid is faster
    (128, 1024, 1024, dict(window=(128, 128)), False),
    (128, 1024, 1024, dict(has_segments=True), False),
    (128, 1024, 1024, dict(interpret=True), False),   # compiled only, as clusters
    (96, 1024, 1024, {}, False),                      # measured at head_dim 128 only
    (256, 1024, 1024, {}, False),
])
def test_default_persistent(d, sq, skv, opts, expected):
    """Short keys without a position mask run the persistent forward (docs/tuning.md)."""
    opts = dict(dict(interpret=False), **opts)
    cfg = default_forward_config(d, make_spec(sq, skv, d, jnp.bfloat16, **opts))
    assert cfg.persistent == expected
    assert cfg.cluster == 1 or not expected


def test_backward_config_validation():
    with pytest.raises(ValueError, match="dq_block_kv"):
        B(dq_block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        B(dq_stages=1)
    with pytest.raises(ValueError, match="dq_compute_wgs"):
        B(dq_compute_wgs=3)
    with pytest.raises(ValueError, match="fused_dq_slots"):
        B(fused_dq_slots=3)
    for d in (64, 128, 256):
        cfg = default_backward_config(d)
        assert cfg.dkdv_smem_bytes(d) <= SMEM_LIMIT
        assert cfg.dq_smem_bytes(d) <= SMEM_LIMIT


@pytest.mark.parametrize("d", range(32, 257, 16))
def test_default_backward_fits_every_head_dim(d):
    """Every Mosaic head_dim's default backward fits shared memory (with MLA's narrower V
    too), and dK/dV's column slices are whole 16s (wgmma steps) that tile the width."""
    cfg = default_backward_config(d)
    if cfg.fused:
        assert cfg.fused_smem_bytes(d) <= SMEM_LIMIT
    splits = cfg.dkdv_col_splits(d)
    for d_v in sorted({d, min(d, 128), 32}):
        assert cfg.dkdv_smem_bytes(d, head_dim_v=d_v) <= SMEM_LIMIT
        assert cfg.dq_smem_bytes(d, head_dim_v=d_v) <= SMEM_LIMIT
        slices = cfg.dkdv_col_slices(d_v, splits)
        assert len(slices) == splits and slices[0][0] == 0
        if splits == 2:
            assert slices[1][0] == slices[0][1]   # the second starts where the first ends
        assert sum(n for _, n in slices) == d_v
        assert all(n > 0 and n % 16 == 0 for _, n in slices)
    # Two dQ warpgroups wherever they fit: up to 208 (from 224 they would not).
    assert cfg.dq_compute_wgs == (1 if d > 208 else 2)
