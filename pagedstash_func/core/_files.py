"""Files written whole or not at all: a save that is killed part-way leaves the previous file
where it was."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

import torch

__all__ = ["save_atomic"]


def save_atomic(obj, path) -> None:
    """``torch.save(obj, path)``, atomically: the bytes go to a hidden temporary file in the
    same folder, are flushed and synced to disk, and only then renamed over ``path``
    (``os.replace``, an atomic rename on POSIX file systems), and the folder's entry is synced
    too. A process killed at any point leaves either the old file or the new one, never a
    part of either (a killed save may leave its hidden ``.<hex>.tmp`` file behind); a save
    that raises removes its temporary file. A symbolic link at ``path`` is written through
    (its target is replaced), and a file that was there keeps its permission bits.
    Errors name ``path``, not the temporary file."""
    path = os.path.realpath(os.fspath(path))
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{secrets.token_hex(6)}.tmp")   # short: any legal name fits
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename == tmp:
            raise type(err)(err.errno, err.strerror, path) from None
        raise
    sync_folder(folder)


def sync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (where the platform lets a folder be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:                              # Windows: folders cannot be opened so
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
