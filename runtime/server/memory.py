"""Giving the memory of a large request back to the operating system once it is answered.

glibc keeps freed heap memory for reuse, and after each large free it raises its mmap threshold
(up to 32 MiB), so the buffers of one large body (raw bytes, the decoded text, the parsed
object) are next allocated from arena heaps that are not trimmed: without this the server's
resident memory stayed 60-150 MiB higher after each 31 MiB body had been refused, and did not
come back. `malloc_trim(0)` returns the free pages of every arena. Elsewhere than glibc it is a
no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util

LARGE_BODY_BYTES = 1 << 20  # bodies from this size on are followed by a trim


def _trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _trim()


def release_freed_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
