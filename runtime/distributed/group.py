"""Process groups from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...).

Two groups per process:

* the **data group** (NCCL on GPUs, gloo on CPU) carries the EP collectives: dispatch/combine
  all-to-alls, the EPLB load all-reduce and expert-weight exchange;
* the **control group** (always gloo, host tensors) carries the per-step handshake every rank
  makes before running anything (how many tokens, who is still active, did anyone fail), so
  the host learns whether to run a step without a device sync on the compute stream. On CPU it is
  the data group itself.

`init_from_env()` works under torchrun, under `launch()` (runtime/distributed/launch.py) and in a
plain single process (no WORLD_SIZE: a one-rank context without torch.distributed).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

DEFAULT_TIMEOUT_S = 300  # a collective nobody joins fails after this long instead of hanging


@dataclass
class DistContext:
    """This process's place in the job."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str  # "nccl", "gloo" or "none" (single process)
    data_group: object = None  # torch.distributed ProcessGroup (None: single process)
    control_group: object = None

    @property
    def distributed(self) -> bool:
        return self.data_group is not None

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.world} ({self.backend}, {self.device})"


def env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def init_from_env(*, device: str | None = None, backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the job described by torchrun's variables (or return a single-process context).

    device: "cpu", "cuda" (-> cuda:LOCAL_RANK) or "cuda:N"; default cuda when available.
    backend: default nccl for CUDA devices, gloo for CPU.
    """
    import torch.distributed as dist

    world = env_int("WORLD_SIZE")
    rank = env_int("RANK", 0)
    local = env_int("LOCAL_RANK", rank)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device}: no CUDA device is available; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", local % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
    if world is None:
        return DistContext(0, 1, 0, dev, "none")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={world} is set but {var} is not: launch with torchrun "
                               "(or megagraph's --nproc), which sets both")
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        kw = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
    data = dist.group.WORLD
    control = data if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(rank, world, local, dev, backend, data, control)


def shutdown(ctx: DistContext | None = None, *, barrier: bool = False) -> None:
    """Leave the job (idempotent). `barrier`: first wait until every rank is leaving too (on the
    success path: a rank tearing its groups down while a peer still talks to it can abort the
    peer's process), never after a failure (the others may never come)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            group = ctx.control_group if ctx is not None and ctx.control_group is not None else None
            dist.barrier(group=group)
        # a ProcessGroup object that outlives destroy_process_group() is destroyed at interpreter
        # exit, which can abort the process ("terminate called without an active exception")
        from megagraph.kernels.parallel.reference import set_ep_group

        set_ep_group(None)
        if ctx is not None:
            ctx.data_group = ctx.control_group = None
        gc.collect()
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for a single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


__all__ = ["DEFAULT_TIMEOUT_S", "DistContext", "env_int", "free_port", "init_from_env", "shutdown"]
