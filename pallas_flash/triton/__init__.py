"""Kernels lowered through Pallas Triton: forward.py and backward.py."""
