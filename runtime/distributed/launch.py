"""Starting N ranks: spawn them here (`launch`), or re-exec the command under torchrun.

Two ways, same environment contract (torchrun's: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so rank code only ever calls
`init_from_env()` (runtime/distributed/group.py):

* `launch(fn, nproc, *args)` spawns `nproc` processes on this machine (torch.multiprocessing's
  spawn context, a free port on 127.0.0.1), runs `fn(*args)` in each and returns the results by
  rank. The first failing rank stops the others (no rank is left hanging in a collective), and
  `timeout_s` bounds the whole run. Tests and single-node tools use it.
* `relaunch_under_torchrun(nproc, argv)` replaces this process by
  `python -m torch.distributed.run --nproc-per-node N ... -m megagraph.main <argv>`: what
  `megagraph runtime serve ARTIFACTS --nproc N` does when it is not already a rank (the serve
  command's author calls it first thing; see docs/parallelism.md). Multi-node jobs pass
  `nnodes` / `rdzv_endpoint` (torchrun's c10d rendezvous) or run torchrun themselves.
"""

from __future__ import annotations

import io
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .group import free_port, shutdown


def torchrun_argv(nproc: int, argv: Sequence[str], *, nnodes: int = 1,
                  rdzv_endpoint: str | None = None, rdzv_id: str = "megagraph",
                  module: str = "megagraph.main", python: str | None = None) -> list[str]:
    """The torchrun command running `python -m <module> <argv>` on `nproc` ranks per node.

    One node: `--standalone` (a local rendezvous on a free port). Several nodes: the same command
    on every node with `nnodes` and the c10d rendezvous endpoint HOST:PORT of one of them."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    argv = strip_flags(argv)
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone"]
    else:
        if not rdzv_endpoint:
            raise ValueError(f"--nnodes {nnodes} needs a rendezvous endpoint HOST:PORT reachable "
                             "from every node (--rdzv-endpoint)")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    return cmd + ["-m", module, *argv]


LAUNCHER_FLAGS = ("--nproc", "--nnodes", "--rdzv-endpoint")  # consumed here, not by the ranks


def strip_flags(argv: Sequence[str], flags: Sequence[str] = LAUNCHER_FLAGS) -> list[str]:
    """argv without `flags` and their values (`--nproc 4` or `--nproc=4`). torchrun's own parser
    rejects a forwarded `--nproc` as an ambiguous abbreviation of its --nproc-per-node, and the
    ranks must not see a launcher flag anyway."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def is_rank_process() -> bool:
    """Was this process started as one rank of a job (torchrun or launch)?"""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def relaunch_under_torchrun(nproc: int, argv: Sequence[str], **torchrun_kw) -> bool:
    """Re-exec this command under torchrun with `nproc` ranks unless that is unnecessary.

    Returns False (and does nothing) when `nproc` is 1 or this process already is a rank; it never
    returns otherwise (os.execv). `argv` is the megagraph command line after the program name,
    e.g. ["runtime", "serve", "artifacts/", "--nproc", "4"]: the ranks get it without the launcher
    flags (--nproc, --nnodes, --rdzv-endpoint), see WORLD_SIZE and carry on as ranks."""
    if nproc <= 1 or is_rank_process():
        return False
    cmd = torchrun_argv(nproc, argv, **torchrun_kw)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return True  # pragma: no cover


# -- spawning here ----------------------------------------------------------------------------------
def _worker(fn: Callable, rank: int, nproc: int, port: int, args: tuple, results, env: dict,
            threads: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    os.environ.update(env)
    if threads:
        torch.set_num_threads(threads)
    ok = False
    try:
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
        ok = True
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            shutdown(barrier=ok)
        except Exception as e:  # noqa: BLE001 - the result (or error) is already reported
            print(f"rank {rank}: shutdown failed: {e}", file=sys.stderr)


def launch(fn: Callable, nproc: int, *args: Any, timeout_s: float | None = 600,
           env: dict[str, str] | None = None, threads: int = 1) -> list[Any]:
    """Run `fn(*args)` on `nproc` freshly spawned ranks of one job; returns [result of rank r].

    `fn` must be importable (a module-level function) and its result saveable with torch.save.
    Raises RuntimeError with the rank's traceback as soon as one rank fails (the others are
    stopped), TimeoutError naming the ranks still running after `timeout_s` seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, nproc, port, args, results, dict(env or {}),
                                               threads), name=f"megagraph-rank{r}")
             for r in range(nproc)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(got) < nproc:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                missing = sorted(set(range(nproc)) - set(got))
                raise TimeoutError(f"rank(s) {missing} of {nproc} did not finish within {timeout_s} s "
                                   "(a collective some rank never joined?)")
            try:
                rank, ok, payload = results.get(timeout=wait)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} exited with code(s) "
                                       f"{[procs[r].exitcode for r in dead]} without a result")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {nproc} failed:\n{payload}")
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == nproc else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [got[r] for r in range(nproc)]


__all__ = ["LAUNCHER_FLAGS", "is_rank_process", "launch", "relaunch_under_torchrun", "strip_flags",
           "torchrun_argv"]
