"""Triton kernels (CUDA; the Triton interpreter runs them on CPU tensors in tests)."""
