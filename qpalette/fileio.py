"""Atomic writes and checked JSON reads: a killed run never leaves a file that looks complete."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qpalette.errors import QpaletteError

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no advisory lock, a second writer goes undetected there
    fcntl = None


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1) + "\n")


def read_json_object(
    path: str | Path, what: str, error: type[Exception], fmt: str | None = None, hint: str = ""
) -> dict:
    """Parse a JSON object from `path`, raising `error` with a message naming `what` and the file;
    with `fmt`, also require its `format` field to equal fmt (`hint` says where such files come from)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} file {str(path)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"cannot read {what} file {p}: {e}") from e
    if not isinstance(data, dict):
        raise error(f"{what} file {p} is not a JSON object")
    if fmt is not None and data.get("format") != fmt:
        raise error(
            f"{p}: format is {data.get('format')!r}, expected {fmt!r}" + (f" ({hint})" if hint else "")
        )
    return data


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@contextmanager
def folder_written_whole(target: str | Path) -> Iterator[Path]:
    """Yield TARGET.partial (emptied first); when the block completes it replaces TARGET (a folder
    or a file), and when it fails it is removed: a killed write never looks complete."""
    target = Path(target)
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def lock_path(path: str | Path) -> Path:
    """Where the lock of an output lives: beside it, `<output>.lock` (`OUT.lock`, `sens.json.lock`)."""
    p = Path(os.path.abspath(path))
    return p.with_name(p.name + ".lock")


@contextmanager
def output_lock(path: str | Path, what: str, error: type[Exception] = QpaletteError) -> Iterator[Path | None]:
    """Hold an exclusive advisory lock on `<path>.lock` while `path` (a file or a folder) is written;
    a second writer of the same output gets `error` naming the holder's PID and `what` (e.g.
    "qpalette compress"). On exit the lock file is removed.

    flock, not a PID file: the kernel drops the lock when its holder dies (even by SIGKILL), so a
    crashed run never leaves a stale lock. A lock file left behind by one is simply taken over; the
    PID and `what` written into it only serve to name the holder. Yields the lock file (None where
    there is no fcntl, or the file system cannot lock: then nothing is locked)."""
    if fcntl is None:
        yield None
        return
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise error(f"{path} is being written by another qpalette process ({holder}); "
                        "wait for it or stop it") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            lock.unlink(missing_ok=True)
            fd = None  # a file system without locks: write unguarded rather than refuse
            break
        # the previous holder removes its file on exit: if it did so between our open and our flock,
        # we hold a lock on a file nobody else will open; start again on the one at the path now
        if _same_file(fd, lock):
            break
        os.close(fd)
    if fd is None:
        yield None
        return
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{what}\n".encode())
        yield lock
    finally:
        if _same_file(fd, lock):  # removed while still locked: nobody can lock this file any more
            lock.unlink(missing_ok=True)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _lock_holder(fd: int) -> str:
    """Who holds a lock, e.g. "PID 1234, qpalette compress", from its file (which the holder may
    still be writing: an unfinished file is read again for up to half a second)."""
    for _ in range(20):
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        if text.endswith("\n"):
            pid, _, what = text.partition("\n")
            return f"PID {pid.strip()}" + (f", {what.strip()}" if what.strip() else "")
        time.sleep(0.025)
    return "PID unknown"
