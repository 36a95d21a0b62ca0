"""The `megagraph runtime serve` process a serving benchmark measures: started as a user starts it
(the CLI in its own process, its log in a file), ready when /health answers 200, its start-up
report and memory read back, stopped with SIGTERM (the server drains), then SIGKILL.

The wait for /health fails as soon as the process exits, with the log's tail, so that a server
that dies while loading weights or capturing graphs costs seconds, not the whole time limit.
Memory: the process's resident set from /proc, the GPU's from nvidia-smi (the process's own row
where the driver lists compute processes, else the whole device, which then holds only this
server): /metrics has no memory gauges.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ServerFailed(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(base_url: str, timeout: float = 5.0) -> int | None:
    """GET /health's status code, None when nothing answers."""
    import httpx

    try:
        return httpx.get(base_url + "/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


@dataclass
class ServerProcess:
    """A server this benchmark started (proc set) or one it was pointed at (proc None)."""

    base_url: str
    proc: subprocess.Popen | None = None
    argv: list[str] = field(default_factory=list)
    log_path: Path | None = None
    ready_s: float | None = None  # spawn -> first /health 200

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def startup(self) -> dict:
        """The server's start-up report ([megagraph] lines on stderr), parsed where it has
        numbers: phases (s), graph memory (MiB), state-cache line, prefill cap."""
        return parse_startup(self.log_text(), self.ready_s)

    def memory(self) -> dict:
        return read_memory(self.pid)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after `timeout`; the exit code (None: not ours)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(artifacts: str | Path, *, device: str, extra: str | list[str] = "",
                 log_path: Path, timeout: float = 600.0, port: int | None = None,
                 env: dict | None = None) -> ServerProcess:
    """`python -m megagraph.main runtime serve ARTIFACTS --device DEVICE --port P EXTRA...`,
    stdout and stderr into `log_path`; returns once /health answers 200. Raises ServerFailed
    (the process killed) when it exits first or `timeout` passes."""
    port = port or free_port()
    extra = shlex.split(extra) if isinstance(extra, str) else list(extra)
    argv = [sys.executable, "-m", "megagraph.main", "runtime", "serve", str(artifacts),
            "--device", device, "--host", "127.0.0.1", "--port", str(port), *extra]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    log.close()
    srv = ServerProcess(f"http://127.0.0.1:{port}", proc, argv, log_path)
    deadline = t0 + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise ServerFailed(f"the server exited with code {proc.returncode} before "
                                   f"/health answered:\n{srv.log_tail()}")
            if health(srv.base_url, timeout=2.0) == 200:
                srv.ready_s = round(time.perf_counter() - t0, 2)
                return srv
            if time.perf_counter() > deadline:
                raise ServerFailed(f"/health did not answer 200 within {timeout:.0f} s:\n"
                                   f"{srv.log_tail()}")
            time.sleep(0.5)
    except BaseException:  # not ready, or the caller stopped waiting: leave no server behind
        srv.stop(timeout=10)
        raise


def attach(url: str) -> ServerProcess:
    """A server already running at `url` (not stopped by the benchmark)."""
    code = health(url.rstrip("/"))
    if code != 200:
        raise ServerFailed(f"{url}/health answered {code}")
    return ServerProcess(url.rstrip("/"))


_PHASES = re.compile(r"start-up ([\d.]+)s: (.*)")
_GRAPH = re.compile(r"graph memory ([\d.]+) MiB")
_CAP = re.compile(r"prefill cap (\d+) tokens/step")


def parse_startup(log: str, ready_s: float | None = None) -> dict:
    lines = [ln.split("[megagraph] ", 1)[1] for ln in log.splitlines() if "[megagraph] " in ln]
    out: dict = {"lines": lines, "ready_s": ready_s}
    for ln in lines:
        if m := _PHASES.match(ln):
            out["engine_s"] = float(m.group(1))
            out["phases_s"] = {k: float(v.rstrip("s")) for k, v in
                               (p.rsplit(" ", 1) for p in m.group(2).split(", ") if " " in p)}
        if m := _GRAPH.search(ln):
            out["graph_memory_mib"] = float(m.group(1))
        if m := _CAP.search(ln):
            out["prefill_cap"] = int(m.group(1))
        if ln.startswith("state cache: "):
            out["state_cache"] = ln[len("state cache: "):]
    return out


def read_memory(pid: int | None) -> dict:
    """{"rss_mib": the process's resident set, "gpu_mib": its GPU memory (or the device's used
    memory, "gpu_scope" says which), "gpu_total_mib"}; keys absent where nothing can be read."""
    out: dict = {}
    if pid is not None:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            kb = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
            out["rss_mib"] = round(kb / 1024, 1)
        except (OSError, AttributeError):
            pass
    try:
        apps = _smi("--query-compute-apps=pid,used_memory")
        mine = [float(r[1]) for r in apps if pid is not None and r and r[0] == str(pid)]
        gpu = _smi("--query-gpu=memory.used,memory.total")[0]
        out["gpu_total_mib"] = float(gpu[1])
        if mine:
            out["gpu_mib"], out["gpu_scope"] = sum(mine), "process"
        else:
            out["gpu_mib"], out["gpu_scope"] = float(gpu[0]), "device"
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    return out


def _smi(query: str) -> list[list[str]]:
    p = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=20, check=True)
    return [[c.strip() for c in ln.split(",")] for ln in p.stdout.splitlines() if ln.strip()]
