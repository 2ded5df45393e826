"""The files of a run directory, written without following symbolic links, and its lock.

A run directory is written only through these functions, so a link planted in it (``.lock``,
``config.json.tmp``, ``metrics.jsonl``, ``summary.json.tmp``, ...) pointing elsewhere is refused
with :class:`RunDirError` naming it, and nothing outside the directory is opened, truncated or
written: every open uses ``O_NOFOLLOW`` (the kernel refuses a link as the last path component,
``ELOOP``), and a file replaced by rename is checked not to be a link first.

:func:`dir_lock` takes an exclusive ``fcntl.flock`` on ``DIR/.lock``: a second writer is refused at
once, naming the holder's pid; the kernel drops the lock when the holder dies, so a crash never
leaves a stale lock, and a holder that ends removes the file. :func:`lock_holder` tells a reader whether a writer holds it.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import IO

__all__ = ["DirLock", "RunDirError", "atomic_write", "dir_lock", "lock_holder", "open_nofollow", "open_text"]

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


class DirLock:
    """A held ``DIR/.lock`` (:func:`dir_lock`): :meth:`close` removes the file while it still holds the
    lock, then drops the lock, so no empty ``.lock`` stays behind a finished run. Also a context manager."""

    def __init__(self, f: IO[str], path: Path):
        self.file, self.path = f, path

    @property
    def closed(self) -> bool:
        return self.file.closed

    def close(self) -> None:
        if self.file.closed:
            return
        try:
            if _is_file_at(self.file, self.path):  # ours (never a file another writer made since)
                os.unlink(self.path)
        except OSError:
            pass  # a read-only directory: the file stays, the lock is still dropped
        finally:
            self.file.close()

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_file_at(f: IO[str], path: Path) -> bool:
    """Whether the open file ``f`` is the file at ``path`` now (not one unlinked since it was opened)."""
    try:
        there = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


_LOCK_TRIES = 100  # a holder removing its .lock between our open and our lock: try the new file, this often


def dir_lock(out: Path) -> DirLock:
    """Hold ``out/.lock`` exclusively (pid written in it) until the returned lock is closed (which removes
    the file). A process that opened the file just before its holder removed it locks a file no longer
    in the directory: it sees that and takes the lock of the file now there, so two writers never hold
    the directory at once."""
    for _ in range(_LOCK_TRIES):
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
        if not _is_file_at(f, out / LOCK):  # removed by the holder we raced with
            f.close()
            continue
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        return DirLock(f, out / LOCK)
    raise RunDirError(f"{out}: its .lock was replaced {_LOCK_TRIES} times while this process tried to take it; "
                      "another process keeps starting and ending writers there")


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
        if not _is_file_at(f, out / LOCK):  # its holder removed it meanwhile: ask the file there now, if any
            return lock_holder(out)
        return None
