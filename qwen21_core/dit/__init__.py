"""The diffusion transformer: model, attention, sequence layout, prefix K/V cache, CUDA-graph decode."""
