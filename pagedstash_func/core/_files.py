"""Files written whole or not at all: a save that is killed part-way leaves the previous file
where it was."""

from __future__ import annotations

import contextlib
import os
import secrets

import torch

__all__ = ["save_atomic"]


def save_atomic(obj, path) -> None:
    """``torch.save(obj, path)``, atomically: the bytes go to a hidden temporary file beside
    ``path``, are flushed and synced to disk, and only then renamed over ``path``
    (``os.replace``, atomic on POSIX and Windows), and the folder's entry is synced too. A
    process killed at any point leaves either the old file or the new one, never a part of
    either; a save that raises removes its temporary file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_folder(folder)


def _sync_folder(folder: str) -> None:
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
