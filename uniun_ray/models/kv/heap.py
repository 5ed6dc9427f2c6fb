"""Hand the C heap's free pages back to the system once KV tensors are let go.

The prefix cache's KV lives in many mid-sized tensors (a layer's keys or values of one run),
which glibc's malloc serves from its heaps (arenas) rather than from a mapping of their own once
its mmap threshold has risen past them. Freed, they leave holes between tensors still held, and
a heap gives memory back only from its top: with the cache at its budget, every eviction
freeing KV and the next runs allocating KV of other sizes, the process's resident memory kept
growing while the bytes it held stayed flat. ``malloc_trim(0)`` releases the free
pages inside every arena too.
Elsewhere (musl, macOS) there is no such call and ``trim`` does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def trim() -> bool:
    """Give the free pages of every malloc arena back to the system; whether any were."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False
