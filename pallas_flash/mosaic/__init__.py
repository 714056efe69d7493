"""Kernels lowered through Pallas Mosaic GPU for Hopper (sm_90): forward.py (draft, issue 4)."""
