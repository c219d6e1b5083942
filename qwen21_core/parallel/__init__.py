"""One model's work spread over several devices (torch.distributed: NCCL on GPUs, gloo on CPU).

- `ulysses.py`: sequence parallelism as a thin layer over the transformer: each rank keeps a slice of the token
  rows; around attention an all-to-all swaps that for a slice of the heads (Ulysses), so each rank's prefix K/V
  cache holds only its heads.
- `jobs.py`: what one conditioning's run looks like on every rank (CFG parallel: one branch per rank; sequence
  parallel: every branch sharded over all ranks), the same code on rank 0 and in the workers.
- `pool.py`: the worker processes rank 0 starts and owns (one per extra device), their command channel, the
  watchdog, error reporting and recovery; `worker.py` is their main loop; `channel.py` the messages; `group.py`
  the process group itself.
- `recipes.py`: how a worker builds the same DiT as rank 0.

Several hosts (not built): the pieces that assume one machine are the rendezvous store and the command channel
(bound to 127.0.0.1), the workers being children of rank 0, and recipes naming local paths. Across hosts, rank 0
would bind both to a reachable address, a launcher on each host would start its workers with that address (the
same bootstrap as `channel.BOOTSTRAP`), and a recipe would name each host's copy of the checkpoint with its size and
hash. Sequence parallelism exchanges two all-to-alls per block, so it belongs inside one host's NVLink domain;
across hosts CFG parallel (one velocity per step) or whole requests would be split, with a sequence-parallel
subgroup per host.
"""
