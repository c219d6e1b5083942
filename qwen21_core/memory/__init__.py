"""Memory: host<->device prefetching, DiT and text-encoder layer streaming, and the placement planner."""
