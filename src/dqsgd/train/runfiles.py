"""The files of a run directory, written without following symbolic links, and its lock.

A run directory is written only through these functions, so a link planted in it (``.lock``,
``config.json.tmp``, ``metrics.jsonl``, ``summary.json.tmp``, ...) pointing elsewhere is refused
with :class:`RunDirError` naming it, and nothing outside the directory is opened, truncated or
written: every open uses ``O_NOFOLLOW`` (the kernel refuses a link as the last path component,
``ELOOP``), and a file replaced by rename is checked not to be a link first.

:func:`dir_lock` takes an exclusive ``fcntl.flock`` on ``DIR/.lock``: a second writer is refused at
once, naming the holder's pid; the kernel drops the lock when the holder dies, so a crash never
leaves a stale lock. :func:`lock_holder` tells a reader whether a writer holds it.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import IO

__all__ = ["RunDirError", "atomic_write", "dir_lock", "lock_holder", "open_nofollow", "open_text"]

LOCK = ".lock"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (in use, holds another run, a link, not a directory)."""


def _link_error(path: Path) -> RunDirError:
    return RunDirError(f"{path} is a symbolic link; dqsgd never writes through a link in a run directory "
                       f"(remove it, or choose another --out)")


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` with ``O_NOFOLLOW``: a file descriptor, or :class:`RunDirError` if ``path`` is a link."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise


def open_text(path: Path, mode: str) -> IO[str]:
    """``path`` opened as UTF-8 text for ``mode`` "w" (truncate), "a" (append) or "a+" (read and
    append), never through a link."""
    flags = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
             "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}[mode]
    if mode == "w" and path.is_symlink():  # O_TRUNC happens at open: refuse before it
        raise _link_error(path)
    return os.fdopen(open_nofollow(path, flags), mode, encoding="utf-8")


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``path`` via ``path.tmp`` + fsync + rename; on any error (full or read-only disk) the
    temporary file is removed, so a failed write leaves the old file and no ``.tmp`` behind.
    Neither ``path`` nor ``path.tmp`` may be a link (refused before anything is written)."""
    tmp = path.with_name(path.name + ".tmp")
    for p in (path, tmp):
        if p.is_symlink():
            raise _link_error(p)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def dir_lock(out: Path) -> IO[str]:
    """Hold ``out/.lock`` exclusively (pid written in it) until the returned file is closed."""
    f = open_text(out / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            f.close()
            raise
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirError(f"{out} is in use by another dqsgd process (pid {holder}); "
                          f"wait for it to finish or choose another --out") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def lock_holder(out: Path) -> str | None:
    """The pid (as text) of the process writing ``out`` now, or None when no one holds ``out/.lock``."""
    try:
        fd = open_nofollow(out / LOCK, os.O_RDONLY)
    except (FileNotFoundError, RunDirError):
        return None
    with os.fdopen(fd, encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return f.read().strip() or "unknown"
            raise
        return None
