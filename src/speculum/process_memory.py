"""The process's own memory: handing freed heap pages back to the system."""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """Make freed memory leave the process: glibc keeps freed heap memory resident (and raises its
    mmap threshold after large frees, so more of it lands on the heap); ``malloc_trim`` hands every
    free page back. A no-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
