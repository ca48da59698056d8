"""The host memory allocator's part in CPU timings.

On CPU, PyTorch takes tensor memory from the C library's ``malloc``. glibc
serves large blocks with fresh mappings and gives freed ones back to the OS
(``munmap``, or trimming the heap top), so a step that allocates what an
earlier step freed faults its pages in again, zeroed by the kernel. A split
backward frees the live-ins at the end of W and allocates them again in the
next B, so it pays this more often than one fused backward does; on CUDA the
caching allocator keeps freed blocks and nothing of the kind happens.

:func:`minor_faults` counts the page faults a phase takes; :func:`retain_freed_memory`
makes glibc keep freed memory for reuse (``fxsplit bench --malloc retain``),
which is what ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=<large>``
(or an allocator such as jemalloc or tcmalloc) gives a whole program.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_MAX = 32 * 2**20
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB, more than any benchmark frees at once

CHOICES = ("default", "retain")

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]


def minor_faults() -> int | None:
    """Minor page faults this process has taken so far (``getrusage``), or
    ``None`` where the platform does not report them."""
    if resource is None:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def glibc_problem() -> str | None:
    """Why :func:`retain_freed_memory` cannot work here, or ``None`` if it can."""
    libc, _ = platform.libc_ver()
    if libc != "glibc":
        return f"it needs glibc's malloc (this is {platform.system()}, C library {libc or 'unknown'})"
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        return "this process's C library has no mallopt"
    return None


def retain_freed_memory() -> None:
    """Make glibc serve every block below 32 MiB from its heap and never trim
    the heap, for the rest of the process: freed tensor memory is then reused
    without new page faults. Raises ``RuntimeError`` naming the reason where
    that is not possible."""
    problem = glibc_problem()
    if problem is not None:
        raise RuntimeError(f"--malloc retain: {problem}")
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    for param, value, name in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX, "M_MMAP_THRESHOLD"),
                               (_M_TRIM_THRESHOLD, TRIM_THRESHOLD, "M_TRIM_THRESHOLD")):
        if mallopt(param, value) != 1:
            raise RuntimeError(f"--malloc retain: glibc refused mallopt({name}, {value})")


def describe(choice: str) -> str:
    """One line for the report header and the JSON."""
    if choice == "retain":
        return (f"glibc malloc told to keep freed memory (mallopt: mmap threshold {MMAP_THRESHOLD_MAX >> 20} MiB, "
                "no trimming)")
    return "the process's allocator as found (glibc defaults unless the environment changes them)"
