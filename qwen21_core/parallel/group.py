"""The process group of a worker pool: joining, leaving, and aborting it when a rank fails or hangs.

torch.distributed's default group, NCCL between GPUs and gloo on CPU. Rank 0 hosts the rendezvous store (a
TCPStore on a free port); each (re)formed group uses a fresh prefix in it, so a group rebuilt after a failure never
meets the old one's keys. Every collective has the group's timeout.

The store has no authentication, so it listens on the loopback address only, and so do gloo's and NCCL's own
sockets (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to the loopback interface: every rank is on this host). A
TCPStore told to host on "127.0.0.1" still binds every interface (the host name only tells clients where to
connect), so rank 0 binds the listening socket itself and hands it to the store (`master_listen_fd`); the store owns
and closes it.

Failures: a blocked gloo collective ends with an error as soon as a peer leaves the group or exits (its connection
closes) and otherwise at the timeout. A blocked NCCL collective ends only when the local communicator is aborted:
torch's own NCCL watchdog would do that by tearing the whole process down (which would take ComfyUI with it), so
its error handling is switched off (TORCH_NCCL_ASYNC_ERROR_HANDLING=0) and our watchdog aborts instead (pool.py,
worker.py). Torch has no option for it, only that variable, which ProcessGroupNCCL reads once, in its constructor: a
worker gets it in the environment it starts with (pool.py), and rank 0, which is ComfyUI's process, holds it only
while its group is constructed (`_group_environment`), so ComfyUI's environment is left as it was.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # torch's; "0": its watchdog never tears the process down
SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_construction = threading.Lock()


def backend_for(devices) -> str:
    """NCCL when every rank runs on a CUDA device, else gloo."""
    return "nccl" if all(torch.device(d).type == "cuda" for d in devices) else "gloo"


LOOPBACK = "127.0.0.1"


def host_store(timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of the loopback address only (store.port says which)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.fileno())  # fmt: skip
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes the socket when it goes
    return store


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def join(store: dist.Store, generation: int, rank: int, world: int, backend: str, device: torch.device,
         timeout_s: float) -> None:  # fmt: skip
    """Form group number `generation` (leaving any earlier one first). Blocks until every rank has joined."""
    leave()
    with _group_environment(backend):  # gloo's sockets too stay on the loopback interface
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"qwen21-group-{generation}", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,  # constructs the NCCL group now (eager init)
        )


@contextlib.contextmanager
def _group_environment(backend: str):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (NCCL only) and the loopback sockets (`loopback_sockets`) while the group
    is constructed, the values before restored after it (see the module docstring): a worker already has them;
    ComfyUI's process keeps no trace of them."""
    wanted = {**({NCCL_ERROR_HANDLING: "0"} if backend == "nccl" else {}), **loopback_sockets()}
    with _construction:
        before = {name: os.environ.get(name) for name in wanted}
        os.environ.update(wanted)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def loopback_sockets() -> dict[str, str]:
    """The environment that keeps gloo's and NCCL's sockets on the loopback interface ({} where it has no name we
    know: then they choose as they do by default)."""
    try:
        names = {name for _index, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return {}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    return dict.fromkeys(SOCKET_INTERFACE_VARIABLES, loopback) if loopback else {}


def leave() -> None:
    """Leave the group (if any). After a failure the group may be broken; leaving it then still succeeds."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - a broken group is left either way
        log.debug("leaving a broken process group: %s", error)
        _forget_group()


def abort() -> None:
    """End this rank's blocked collectives now (from any thread). NCCL: abort the communicators. gloo cannot abort
    from another thread: a blocked op ends when a peer leaves or at the timeout."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as error:  # noqa: BLE001 - best effort: the group is rebuilt afterwards anyway
        log.warning("aborting the NCCL process group failed: %s", error)


def _forget_group() -> None:
    """Drop torch's record of a default group that could not be destroyed cleanly, so a new one can be made."""
    world = dist.distributed_c10d._world
    world.pg_map.clear()
    world.pg_names.clear()
    world.pg_group_ranks.clear()
    world.pg_backend_config.clear()
    world.pg_to_tag.clear()
    world.tags_to_pg.clear()
    dist.distributed_c10d._update_default_pg(None)
