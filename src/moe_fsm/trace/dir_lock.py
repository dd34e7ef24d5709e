"""One writer at a time in a trace directory: the lock ``moe-fsm run``, ``plan`` and transformers' ``enable()``
hold while they write there.

A run writes one trace per distinct decision, named after the first layer that
got it, then a manifest naming those files. Two runs into one directory at once
would write the same names: the manifest of one would name traces that hold the
other's decisions. So each holds an exclusive ``flock`` on ``DIR/.moe-fsm-lock``
from before its first write to after its manifest, and a second one is refused at
once, naming the holder (its pid and command, which the holder writes into the
file). The holder removes the file as it ends; the kernel drops the lock when its
holder exits, killed or not, so a killed holder's file is no stale lock: the next
run takes it. Torch-free, core.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moe_fsm.errors import TraceWriteError
from moe_fsm.trace.document import file_kind, write_error

LOCK_NAME = ".moe-fsm-lock"
HOLDER_BYTES = 4096  # of the holder's command, kept in the lock file for the refusal to quote


@contextmanager
def trace_dir_lock(directory: str | os.PathLike, flag: str = "--trace-dir") -> Iterator[Path]:
    """Hold ``directory``'s writer lock (creating the directory); TraceWriteError when another process holds it.

    ``flag`` is how the refused command names the directory, for the hint to give it another one.
    """
    directory = Path(directory)
    path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(path, err) from None
    fd = _acquire(directory, path, flag)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)}".encode("utf-8", "replace")[:HOLDER_BYTES], 0)
        yield path
    finally:
        try:
            if _names(path, fd):
                os.unlink(path)  # before the lock drops: a process that opened this file meanwhile sees it gone, retries
        except OSError:
            pass  # the directory went away or turned read-only: the lock still drops, and the next holder takes the file
        os.close(fd)  # drops the lock


def _acquire(directory: Path, path: Path, flag: str) -> int:
    """The open, locked lock file: one whose name still leads to it (its last holder may have removed it)."""
    for _ in range(100):
        fd = _open(directory, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, HOLDER_BYTES, 0).decode("utf-8", "replace").strip() or "a process"
            os.close(fd)
            raise TraceWriteError(f"trace directory {directory} is in use by another moe-fsm run ({holder}): "
                                  f"its traces and manifest would be mixed with this one's; wait for it to end, "
                                  f"or give this one another {flag}") from None
        except OSError as err:
            os.close(fd)
            raise write_error(path, err) from None
        if _names(path, fd):
            return fd
        os.close(fd)  # its holder removed it between our open and our lock: take the new one
    raise TraceWriteError(f"cannot lock trace directory {directory}: {path} keeps being replaced")


def _open(directory: Path, path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise TraceWriteError(f"cannot lock trace directory {directory}: {path} is a symbolic link, not the "
                                  f"regular file moe-fsm keeps there; remove it") from None
        raise write_error(path, err) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise TraceWriteError(f"cannot lock trace directory {directory}: {path} is {file_kind(mode)}, "
                              f"not the regular file moe-fsm keeps there; remove it")
    return fd


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        here = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    there = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
