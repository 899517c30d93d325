"""The scope a `stash_aware` step opens, so that `psf.moe` calls inside know their layer.

Only the transform pushes frames; `current()` is ``None`` outside any step.
"""

from __future__ import annotations

import threading

_LOCAL = threading.local()


def current():
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


class opened:
    """``with opened(frame): ...`` makes ``frame`` current for the block."""

    def __init__(self, frame):
        self.frame = frame

    def __enter__(self):
        if not hasattr(_LOCAL, "stack"):
            _LOCAL.stack = []
        _LOCAL.stack.append(self.frame)
        return self.frame

    def __exit__(self, *exc):
        _LOCAL.stack.pop()
        return False
