"""Kernels lowered through Pallas Mosaic GPU for Hopper (sm_90): forward.py (draft, issue 4;
flash_attention(..., backend="mosaic") reaches it, "auto" does not yet)."""
