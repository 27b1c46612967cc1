"""The C library through ctypes, for the sandbox's own processes (zygote, launcher), and its error check."""

import ctypes
import os

LIBC = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
