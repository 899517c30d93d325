"""The frame a `stash_aware` step opens: what the step knows while the user's loss runs.

A frame is plain data (mode, config, state, the calls recorded or expected, a call counter);
`psf.moe` reads the current frame and picks its path from it. Only the transform opens frames;
`current()` is ``None`` outside any step, where `psf.moe` runs the exact path.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Literal

import torch

from ._config import StashConfig

_LOCAL = threading.local()

Mode = Literal["record", "capacity", "exact"]


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """Static facts of one `psf.moe` call of a step, found by `StashAwareStep.init`.

    A state carries one per call (``state.layers``, in call order); frozen.

    Attributes:
        name: the call's name in the state: ``"moe0"``, ``"moe1"``, ... in call order.
        tokens: ``T``, the tokens the call routes (on this rank).
        top_k: experts chosen per token, ``k``.
        num_experts: ``E``, the router's rows.
        hidden: ``H``, the hidden size.
        ffn: ``F``, each expert's FFN size.
        dtype: the experts' dtype (``w_gate_up``'s).
        expert_ranks: expert-parallel ranks the experts are spread over (real or virtual).
        capacity: rows of the capacity buffer (0 without a capacity factor).
        balanced_rows: ``T * k``.
        observed_rows: rows the experts got when the state was built (non-padding).
        budget: rows per expert rank (0 without a capacity factor).
        group_size: ranks of the process group the experts are spread over.
        transport: how the capacity path moves rows across them (agreed at init).
    """

    name: str
    tokens: int
    top_k: int
    num_experts: int
    hidden: int
    ffn: int
    dtype: torch.dtype
    expert_ranks: int
    capacity: int            # rows of the capacity buffer (0 without a capacity factor)
    balanced_rows: int       # T * k
    observed_rows: int       # rows the experts got when the state was built (non-padding)
    budget: int = 0          # rows per expert rank (0 without a capacity factor)
    group_size: int = 1      # ranks of the process group the experts are spread over
    transport: str = "fixed"  # how the capacity path moves rows across them (agreed at init)


@dataclasses.dataclass
class Frame:
    """What a step knows while its loss runs.

    - ``"record"`` (``step.init``): every call runs exact; its `LayerInfo` is appended to
      ``layers``.
    - ``"capacity"`` (a step call): call ``i`` is ``layers[i]`` of ``state``; the state threads
      through the calls (``state`` is replaced by each call).
    - ``"exact"`` (``step.exact``, the runner's rerun): every call runs exact.
    """

    mode: Mode
    cfg: StashConfig | None = None
    state: object = None
    layers: list = dataclasses.field(default_factory=list)
    calls: int = 0
    device: torch.device | None = None
    anchors: list = dataclasses.field(default_factory=list)   # expert-parallel outputs
    recorded_groups: list = dataclasses.field(default_factory=list)   # (layer, group) (record)
    groups: dict = dataclasses.field(default_factory=dict)   # layer -> its group (capacity)
    compiled: bool = False     # run by psf.compile, which checks the pages' status itself


def under_compile_hook() -> bool:
    """Whether this eager Python runs inside a ``torch.compile``'d call (the compiler's frame
    hook is set: the code fell back from a trace, or runs where the compiler could not go)."""
    return torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


def current() -> Frame | None:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


class opened:
    """``with opened(frame): ...`` makes ``frame`` current for the block."""

    def __init__(self, frame: Frame):
        self.frame = frame

    def __enter__(self) -> Frame:
        if not hasattr(_LOCAL, "stack"):
            _LOCAL.stack = []
        _LOCAL.stack.append(self.frame)
        return self.frame

    def __exit__(self, *exc):
        _LOCAL.stack.pop()
        return False
