"""Kernels lowered through Pallas Mosaic GPU for Hopper (sm_90): forward.py and backward.py.

`flash_attention(..., backend="mosaic")` runs them as they are; "auto" runs them on an sm_90 GPU
behind the finiteness check of pallas_flash/guarded.py. Tiles: benchmarks/mosaic_tune.py."""
