"""Quantised linear layers (FP8 and INT8 W8A8, with a weight-only fallback) and weight quantisation."""
