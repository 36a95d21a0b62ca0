"""Hidden staging dirs of `compile --out DIR`: `.DIR.tmp-*` (being written) and `.DIR.old-*` (the
replaced artifacts, being deleted), next to DIR, and the removal of those an interrupted compile
left behind.

A compile writes into a staging dir and renames it into place, so a compile killed with SIGKILL
never leaves DIR half-written, but it does leave its staging dir. The next compile into the same
parent removes such leftovers, and only those: the name says which host and process made the
dir (`.DIR.tmp-HOST-PID-RANDOM`), so a dir is stale when that process is gone (same host), or,
for a dir of another host (a shared filesystem) or without a parsable owner, when nothing has
touched it for `STALE_AFTER_S` (writing artifacts takes seconds; a compile never holds a staging
dir for an hour). A concurrent compile's dir is never taken: its process is alive.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

STALE_AFTER_S = 3600.0


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"


def make_staging_dir(parent: Path, name: str, kind: str) -> Path:
    """A fresh `.NAME.KIND-HOST-PID-RANDOM` dir in `parent` (kind: tmp or old)."""
    return Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-{_host()}-{os.getpid()}-", dir=parent))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _is_stale(path: Path, name: str, now: float) -> bool:
    m = re.fullmatch(rf"\.{re.escape(name)}\.(?:tmp|old)-(.+)", path.name)
    if m is None:
        return False
    owner = re.fullmatch(r"(.+)-(\d+)-[^-]+", m.group(1))
    if owner is not None and owner.group(1) == _host():
        return not _pid_alive(int(owner.group(2)))
    try:
        age = now - path.lstat().st_mtime
    except OSError:
        return False
    return age > STALE_AFTER_S


def remove_stale_staging_dirs(parent: Path, name: str) -> list[Path]:
    """Remove the staging dirs of `name` in `parent` that an interrupted compile left; returns
    the paths removed."""
    removed, now = [], time.time()
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        if p.name.startswith(f".{name}.") and p.is_dir() and not p.is_symlink() \
                and _is_stale(p, name, now):
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
    return removed
