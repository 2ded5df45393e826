"""The one reader and writer of run-directory files: no link followed, regular files only, bounded
reads, and the directory's lock.

A run directory is read and written only through these functions, so a link planted in it
(``.lock``, ``config.json.tmp``, ``metrics.jsonl``, ``summary.json.tmp``, ...) pointing elsewhere
is refused with :class:`RunDirError` naming it, and nothing outside the directory is opened,
truncated or written: every open uses ``O_NOFOLLOW`` (the kernel refuses a link as the last path
component, ``ELOOP``), and a file replaced by rename is checked not to be a link first. Given the
output root (``--out``), :func:`open_under` opens every directory below it one component at a time
on directory descriptors (``openat`` with ``O_NOFOLLOW | O_DIRECTORY``), and :func:`inside` refuses
a path whose components below the root are links, so a link one level up (``OUT/sgd`` pointing
elsewhere) is refused as well.

Reads (:func:`open_regular`, :func:`read_json`, :func:`read_lines`) open with ``O_NONBLOCK`` and
refuse anything but a regular file (a FIFO never blocks them), and are bounded in bytes: a JSON or
TOML file at most :data:`MAX_FILE_BYTES`, one line of ``metrics.jsonl`` at most
:data:`MAX_LINE_BYTES`, read line by line. A file that is not what dqsgd writes is refused with
:class:`RunDataError` naming the file and, for a line, its number.

:func:`dir_lock` takes an exclusive ``fcntl.flock`` on ``DIR/.lock``: a second writer is refused at
once, naming the holder's pid; the kernel drops the lock when the holder dies, so a crash never
leaves a stale lock. :func:`lock_holder` tells a reader whether a writer holds it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import IO, Any, Iterator

__all__ = ["MAX_FILE_BYTES", "MAX_LINE_BYTES", "RunDataError", "RunDirError", "atomic_write", "dir_lock", "inside",
           "lock_holder", "open_nofollow", "open_regular", "open_text", "open_under", "read_json", "read_lines",
           "read_text"]

LOCK = ".lock"
MAX_FILE_BYTES = 64 << 20  # config.json, summary.json, experiment.toml: dqsgd writes a few KiB
MAX_LINE_BYTES = 1 << 20   # one metrics.jsonl record: dqsgd writes about 500 bytes


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (in use, holds another run, a link, not a directory)."""


class RunDataError(RunDirError):
    """A run directory whose files hold something no run writes: names the file, line and field."""


def _link_error(path: Path) -> RunDirError:
    return RunDirError(f"{path} is a symbolic link; dqsgd never writes through a link in a run directory "
                       f"(remove it, or choose another --out)")


def _parts(root: Path, path: Path) -> tuple[str, ...]:
    """The components of ``path`` below ``root`` (lexically; refused when ``path`` is not below it)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    parts = Path(rel).parts
    if rel == os.curdir:
        return ()
    if parts[0] == os.pardir:
        raise RunDirError(f"{path} is not inside {root}; dqsgd reads and writes a run only under its output directory")
    return parts


def inside(root: Path, path: Path) -> Path:
    """``path`` if none of its components below ``root`` is a link or a file (those not there yet are
    created as directories later); else :class:`RunDirError` naming the first. ``root`` itself may be
    a link: it is the user's choice of output directory."""
    here = Path(root)
    for part in _parts(root, path):
        here = here / part
        if here.is_symlink():
            raise RunDirError(f"{here} is a symbolic link; dqsgd never reads or writes a run through a link below "
                              f"its output directory {root} (remove it, or choose another --out)")
        if here.exists() and not here.is_dir() and here != Path(path):
            raise RunDirError(f"{here} is not a directory")
    return Path(path)


def open_under(path: Path, flags: int, *, root: Path | None = None, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` never through a link: from ``root`` (default: ``path``'s directory),
    every directory below it is opened on the previous one's descriptor with ``O_NOFOLLOW |
    O_DIRECTORY`` (``openat``), then the file with ``O_NOFOLLOW``. A link is refused with
    :class:`RunDirError` naming it."""
    path = Path(path)
    top = path.parent if root is None else Path(root)
    parts = _parts(top, path)
    if not parts:
        raise RunDirError(f"{path} is the output directory itself, not a file in it")
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = top
    try:
        for part in parts[:-1]:
            here = here / part
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and here.is_symlink():
                    inside(top, here)  # raises: names the link below the root
                raise OSError(e.errno, e.strerror, str(here)) from None
            os.close(fd)
            fd = nxt
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_error(path) from None
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` with ``O_NOFOLLOW``: a file descriptor, or :class:`RunDirError` if ``path`` is a link."""
    return open_under(path, flags, mode=mode)


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def open_regular(path: Path, *, root: Path | None = None, max_bytes: int | None = None) -> IO[bytes]:
    """``path`` opened for reading (binary) through :func:`open_under`, with ``O_NONBLOCK`` so that a FIFO
    never blocks the open, then checked with ``fstat``: only a regular file of at most ``max_bytes``
    bytes (None: any size) is returned; anything else is refused with :class:`RunDataError`."""
    return os.fdopen(_open_regular(path, os.O_RDONLY, root, max_bytes), "rb")


def _open_regular(path: Path, flags: int, root: Path | None = None, max_bytes: int | None = None) -> int:
    """:func:`open_under` with ``O_NONBLOCK`` (a FIFO opens at once, or ``ENXIO`` for writing), then
    ``fstat``: the descriptor (blocking again) of a regular file of at most ``max_bytes`` bytes."""
    try:
        fd = open_under(path, flags | os.O_NONBLOCK, root=root)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO that nobody reads, opened for writing
            raise RunDataError(f"{path} is a FIFO, not a regular file; a run directory holds only regular files") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunDataError(f"{path} is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, not a "
                               f"regular file; a run directory holds only regular files")
        if max_bytes is not None and st.st_size > max_bytes:
            raise RunDataError(f"{path} holds {st.st_size} bytes, more than the {max_bytes} dqsgd reads in such a "
                               f"file (not a file dqsgd wrote)")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_text(path: Path, *, root: Path | None = None, max_bytes: int | None = None) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` (default :data:`MAX_FILE_BYTES`)."""
    cap = MAX_FILE_BYTES if max_bytes is None else max_bytes
    with open_regular(path, root=root, max_bytes=cap) as f:
        raw = f.read(cap + 1)
    if len(raw) > cap:  # it grew since the fstat
        raise RunDataError(f"{path} holds more than the {cap} bytes dqsgd reads in such a file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunDataError(f"{path}: unreadable (not UTF-8 text: {e})") from None


def read_json(path: Path, *, root: Path | None = None, max_bytes: int | None = None) -> Any:
    """A JSON file's value (:func:`read_text`); damaged JSON, nesting too deep to read or a number
    Python refuses are :class:`RunDataError` naming the file. A missing file: ``FileNotFoundError``."""
    text = read_text(path, root=root, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RunDataError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def read_lines(path: Path, *, root: Path | None = None, max_line: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of a regular file, read one line at a time; a line longer
    than ``max_line`` bytes (default :data:`MAX_LINE_BYTES`) is refused naming the file and line."""
    cap = MAX_LINE_BYTES if max_line is None else max_line
    with open_regular(path, root=root) as f:
        n = 0
        while line := f.readline(cap + 1):
            n += 1
            if len(line) > cap and not line.endswith(b"\n"):
                raise RunDataError(f"{path}:{n}: a line longer than {cap} bytes; no run writes one (a damaged file?)")
            yield n, line


def open_text(path: Path, mode: str) -> IO[str]:
    """``path`` opened as UTF-8 text for ``mode`` "w" (truncate), "a" (append) or "a+" (read and
    append), never through a link."""
    flags = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
             "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}[mode]
    if mode == "w" and path.is_symlink():  # O_TRUNC happens at open: refuse before it
        raise _link_error(path)
    return os.fdopen(_open_regular(path, flags), mode, encoding="utf-8")


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
        fd = _open_regular(out / LOCK, os.O_RDONLY)
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
