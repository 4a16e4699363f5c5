"""Atomic writes and checked JSON reads: a killed run never leaves a file that looks complete."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
