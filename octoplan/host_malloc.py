"""Host memory allocations that cost the same in every process (:func:`steady_malloc`).

On Linux, torch's CPU tensors come from glibc's ``malloc``. glibc serves a request above its
*mmap threshold* with fresh pages from the kernel and hands them back when the block is freed,
so each such tensor costs page faults every time it is made; and, by default, it raises the
threshold to the size of every such block freed, while trimming the heap's free top back to the
kernel past a threshold it raises alike. Which tensors of a run fault their pages in therefore
depends on the order in which the process happened to allocate and free them before: on this
project's CPU, three back-to-back profiles of the example VLM timed its head's backward at 3.46,
2.39 and 2.38 ms, the first process paying page faults on every repeat that the others did not
(docs/BENCHMARKS.md, "Profiler accuracy").

Fixing both thresholds ends that: blocks up to :data:`MMAP_THRESHOLD` come from the heap and are
reused once freed, in every process alike. The profiler and octorun both do it, so a profile
prices layers as octorun runs them. A process whose user already chose glibc's thresholds
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES``) keeps that choice,
and ``OCTOPIPE_MALLOC=as-is`` leaves glibc's own behaviour (to compare against it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "OPT_OUT", "steady_malloc"]

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024
"""The largest block served from the heap: glibc's own ceiling for a 64-bit process (it refuses
more). A tensor above it still gets fresh pages each time, as it would anyway once the dynamic
threshold had reached that ceiling."""

TRIM_THRESHOLD = 1024 * 1024 * 1024
"""Free memory the heap keeps at its top before handing any back: a training step frees and
reallocates its activations every step, so returning them costs page faults on the next."""

log = logging.getLogger(__name__)

OPT_OUT = "OCTOPIPE_MALLOC"
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_applied: str | None = None


def steady_malloc() -> str:
    """Fix glibc's mmap and trim thresholds for this process, once; returns what the process's
    allocations now follow, for a profile to record: ``"steady"`` (fixed here), ``"user"``
    (thresholds the user set), ``"as-is"`` (``OCTOPIPE_MALLOC=as-is``) or ``"not glibc"``."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> str:
    asked = os.environ.get(OPT_OUT, "").strip().lower()
    if asked == "as-is":
        return "as-is"
    if asked and os.environ.get("RANK", "0") == "0":  # a typo would otherwise go unseen (said once a job)
        log.warning("%s=%s is not its one value, as-is: the allocator's thresholds are fixed as without it",
                    OPT_OUT, os.environ[OPT_OUT])
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "user"
    libc = _glibc()
    if libc is None:
        return "not glibc"
    # mallopt returns 1 on success; a refusal leaves glibc's defaults, which still work
    fixed = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    fixed = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and fixed
    return "steady" if fixed else "as-is"


def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (which has ``gnu_get_libc_version``); None on
    macOS, musl or Windows, where none of this applies."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
