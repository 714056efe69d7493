"""Kernels lowered through Pallas Mosaic GPU for Hopper (sm_90).

forward.py, backward.py and fused_backward.py hold the kernels, config.py their tiles and
budgets, schedule.py their launch order, lowering_cache.py keeps their lowering for the
process and, beside JAX's compilation cache, for later ones. `flash_attention(...,
backend="mosaic")` runs them as they are; "auto" runs them on an sm_90 GPU behind guarded.py's
finiteness check."""

from pallas_flash.mosaic import lowering_cache

# Each kernel is lowered once per process; with JAX's compilation cache on, later processes
# read its lowering back instead of lowering it again (lowering_cache.py).
lowering_cache.install()
