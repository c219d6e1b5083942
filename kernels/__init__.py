"""Triton kernels, each beside its plain-torch reference, reached through dispatchers."""
