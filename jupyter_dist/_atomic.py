"""Atomic file writes: a temporary file in the same folder, fsync, then ``os.replace`` (stdlib only).

Every file a user (or a later command) reads back is written through :func:`write_atomic`: a reader sees the old
file or the whole new one, never half of it, and a write that fails (a full disk, a quota, a folder made read-only)
leaves nothing behind: the temporary file is removed and the target is untouched. The error is re-raised as an
``OSError`` whose ``filename`` is the target (not the temporary name), so callers can say which file in one line
(:func:`describe_write_error`).
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = ["describe_write_error", "write_atomic"]


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns the path.

    The new file has the permissions a plain ``open(path, "w")`` gives it (``0o666`` less the umask) unless ``mode``
    is given. Raises ``OSError`` (``filename`` = ``path``) when the write fails; nothing is left behind then.
    """
    target = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(target)) from None
    try:
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, str(target)) from None
        raise
    return target


def describe_write_error(exc: OSError, path: str | os.PathLike[str] | None = None, *, hint: str = "") -> str:
    """One line for a failed write.

    ``no space left on device writing PATH: HINT`` for a full disk (or a quota), else ``cannot write PATH: <why>``.
    """
    where = exc.filename if exc.filename else path
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        return f"{what} writing {where}" + (f": {hint}" if hint else "")
    return f"cannot write {where}: {exc.strerror or exc}"
