"""One model's work spread over several devices (torch.distributed: NCCL on GPUs, gloo on CPU).

- `ulysses.py`: sequence parallelism as a thin layer over the transformer: each rank keeps a slice of the token
  rows; around attention an all-to-all swaps that for a slice of the heads (Ulysses), so each rank's prefix K/V
  cache holds only its heads.
- `jobs.py`: what one conditioning's run looks like on every rank (CFG parallel: one branch per rank; sequence
  parallel: every branch sharded over all ranks), the same code on rank 0 and in the workers.
- `pool.py`: the worker processes rank 0 starts and owns (one per extra device), their command channel, the
  watchdog, error reporting and recovery; `worker.py` is their main loop; `group.py` the process group itself.
- `recipes.py`: how a worker builds the same DiT as rank 0.
"""
