"""An adaptive capacity factor: a fixed ladder of rungs, and a pure policy that picks each
step's rung from what `run_step` already read once (no new host reads).

Each rung is a `StashConfig` with its own ``capacity_factor``, so shapes stay static per rung.
After a step that reran for over budget the policy climbs straight to the lowest rung its
routing counts say would have fit; it descends only when the lower rung would have fit all
but a ``target_rerun_rate`` share of a window of recent steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from ..core._config import StashConfig
from ..stash._state import StashState
from ._runner import StepReport, StepResult, run_step
from ._transform import stash_aware

__all__ = ["AdaptiveState", "AdaptiveStep", "Ladder", "LadderMove", "adaptive"]


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The rungs (capacity factors, increasing) and the policy's knobs.

    ``target_rerun_rate``: the share of steps that may rerun for over budget; ``window``:
    how many recent steps the descent reads (default ``ceil(1 / target)``, at least 10: the
    fewest steps in which "all but that share fit" says anything), so a rung is left
    downward only when the one below would have fit all but that share of them; ``start``: the rung of the first step (default the top one, which reruns least
    while nothing is known yet).
    """

    rungs: tuple = (1.0, 1.1, 1.25, 1.5, 2.0)
    target_rerun_rate: float = 0.02
    window: int | None = None
    start: int | None = None

    def __post_init__(self):
        rungs = tuple(self.rungs)
        if not rungs or any(not isinstance(r, (int, float)) or isinstance(r, bool)
                            or not math.isfinite(r) or r <= 0 for r in rungs) \
                or list(rungs) != sorted(set(rungs)):
            raise ValueError(f"Ladder(rungs={self.rungs!r}): capacity factors > 0, strictly "
                             f"increasing, e.g. (1.0, 1.1, 1.25, 1.5, 2.0)")
        object.__setattr__(self, "rungs", tuple(float(r) for r in rungs))
        if not 0 < self.target_rerun_rate < 1:
            raise ValueError(f"Ladder(target_rerun_rate={self.target_rerun_rate!r}) must be "
                             f"in (0, 1)")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"Ladder(window={self.window!r}) must be a positive integer")
        if self.start is not None and not 0 <= self.start < len(rungs):
            raise ValueError(f"Ladder(start={self.start!r}) must index one of the "
                             f"{len(rungs)} rungs")

    @property
    def steps_seen(self) -> int:
        return self.window or max(10, math.ceil(1 / self.target_rerun_rate))

    def fitting_rung(self, needed: float) -> int:
        """The lowest rung at or above ``needed`` (the top one if none is)."""
        for i, r in enumerate(self.rungs):
            if r >= needed:
                return i
        return len(self.rungs) - 1

    def decide(self, rung: int, history: tuple, report: StepReport):
        """``(next rung, history, LadderMove)`` after a step at ``rung`` with ``report``: a
        pure function of its arguments (``history``: the factors recent steps needed)."""
        if not isinstance(rung, int) or not 0 <= rung < len(self.rungs):
            raise ValueError(f"rung {rung!r} is not one of this ladder's {len(self.rungs)} "
                             f"rungs (an AdaptiveState from another ladder?)")
        needed = needed_factor(report)
        history = (history + (needed,))[-self.steps_seen:]
        if report.over_budget:
            up = max(rung + 1, self.fitting_rung(needed)) if needed > self.rungs[rung] \
                else rung
            up = min(up, len(self.rungs) - 1)
            return up, history, LadderMove(rung, up, needed, "reran over budget: climb to "
                                                          "the rung that would have fit")
        if rung > 0 and len(history) >= self.steps_seen:
            allowed = math.floor(self.target_rerun_rate * len(history))
            over = sum(h > self.rungs[rung - 1] for h in history)
            if over <= allowed:
                return rung - 1, (), LadderMove(
                    rung, rung - 1, needed, f"the rung below would have fit {len(history) - over}"
                                            f" of the last {len(history)} steps")
        return rung, history, LadderMove(rung, rung, needed, "stay")


class LadderMove(NamedTuple):
    """What the policy did after a step: from and to which rung, the factor the step needed
    (its largest rank load over the balanced reference), and why."""

    rung: int
    next_rung: int
    needed: float
    why: str


def needed_factor(report: StepReport) -> float:
    """The smallest capacity factor under which no layer of the step would have gone over
    budget: the largest rank load over the balanced reference (counted before any drop)."""
    return max((max(layer.load_ratio, default=0.0) for layer in report.layers), default=0.0)


@dataclasses.dataclass
class AdaptiveState:
    """What an adaptive loop threads: the rung, the recent needs, a `StashState` per rung
    built so far (each consumed by its steps as usual), and the moves made (one per step)."""

    rung: int
    history: tuple
    states: dict
    moves: tuple = ()


class AdaptiveStep:
    """``res, astate = astep(params, batch, astate)``: `run_step` at the rung the policy
    chose, then the policy's move (``astate.moves[-1]``). See `adaptive`."""

    def __init__(self, loss_fn, cfg: StashConfig, ladder: Ladder, graph: bool = False,
                 max_graphs: int = 2):
        if not isinstance(cfg, StashConfig):
            raise ValueError(f"cfg must be a psf.StashConfig, got {type(cfg).__name__}")
        if not isinstance(ladder, Ladder):
            raise ValueError(f"ladder must be a psf.Ladder, got {type(ladder).__name__}")
        if cfg.paged_stash and cfg.pool_scope != "layer":
            raise ValueError("an adaptive step keeps a state per rung: with pool_scope='state' "
                             "each would hold its own pools between steps. Use "
                             "pool_scope='layer' (pools live only within a step) or "
                             "paged_stash=False")
        self.ladder = ladder
        self.steps = tuple(stash_aware(loss_fn, dataclasses.replace(cfg, capacity_factor=r))
                           for r in ladder.rungs)
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive integer, got {max_graphs!r}")
        self.graph, self.max_graphs = bool(graph), max_graphs
        self._graphs: dict = {}          # rung -> GraphedStep, the most recently used kept

    def init(self, params, batch) -> AdaptiveState:
        rung = self.ladder.start if self.ladder.start is not None else len(self.ladder.rungs) - 1
        return AdaptiveState(rung, (), {rung: self.steps[rung].init(params, batch)})

    def __call__(self, params, batch, astate: AdaptiveState, **kwargs) -> tuple[StepResult,
                                                                             AdaptiveState]:
        if not isinstance(astate, AdaptiveState):
            raise TypeError(f"the third argument must be the AdaptiveState from "
                            f"astep.init (or the one the previous call returned), got "
                            f"{type(astate).__name__}")
        rung = astate.rung
        states = dict(astate.states)
        state = states.pop(rung, None)
        if state is None:                 # first visit: its state, built for this batch
            state = self.steps[rung].init(params, batch)
        res = self._runner(rung)(params, batch, state, **kwargs)
        states[rung] = res.state
        nxt, history, move = self.ladder.decide(rung, astate.history, res.report)
        return res, AdaptiveState(nxt, history, states, astate.moves + (move,))

    def _runner(self, rung):
        """`run_step` of the rung's step, or its `psf.graphed` (at most ``max_graphs`` rungs'
        graphs kept: a graph holds its private pool, about a step's peak)."""
        if not self.graph:
            return lambda *a, **k: run_step(self.steps[rung], *a, **k)
        from ._graph import graphed
        runner = self._graphs.pop(rung, None) or graphed(self.steps[rung])
        self._graphs[rung] = runner                         # most recent last
        while len(self._graphs) > self.max_graphs:
            oldest = next(iter(self._graphs))
            self._graphs.pop(oldest).clear()
        return runner

    def save_step(self, path, params, batch, astate: AdaptiveState, **kwargs) -> None:
        """`psf.save_step` of the next step (at ``astate``'s rung) with the policy's state
        (rung, history, moves): `load` resumes the run from it, `psf.replay_step` replays
        that one step."""
        from ._replay import save_step
        state = astate.states.get(astate.rung)
        if state is None:
            state = self.steps[astate.rung].init(params, batch)
            astate.states[astate.rung] = state
        policy = {"rungs": list(self.ladder.rungs), "rung": astate.rung,
                  "history": list(astate.history),
                  "moves": [[m.rung, m.next_rung, m.needed, m.why] for m in astate.moves]}
        save_step(path, self.steps[astate.rung], params, batch, state, policy=policy, **kwargs)

    def load(self, path, loss_fn, **kwargs) -> tuple:
        """``(params, batch, astate)`` from a file of `save_step`: the run resumes with the
        policy where it was (the rung's state from the file; other rungs' states are built
        again when visited). `ValueError` for a file of another ladder."""
        from ._replay import load_policy, load_step
        policy = load_policy(path)
        if not isinstance(policy, dict) or policy.get("rungs") != list(self.ladder.rungs):
            raise ValueError(f"{path} was not saved by an adaptive step of this ladder "
                             f"({self.ladder.rungs})")
        _, params, batch, state = load_step(path, loss_fn, **kwargs)
        rung = policy["rung"]
        moves = tuple(LadderMove(int(a), int(b), float(n), str(w))
                      for a, b, n, w in policy["moves"])
        return params, batch, AdaptiveState(rung, tuple(float(h) for h in policy["history"]),
                                            {rung: state}, moves)

    def factor(self, astate: AdaptiveState) -> float:
        """The capacity factor the next call runs at."""
        return self.ladder.rungs[astate.rung]


def adaptive(loss_fn, cfg: StashConfig, ladder: Ladder | None = None, *, graph: bool = False,
             max_graphs: int = 2) -> AdaptiveStep:
    """A step whose capacity factor follows ``ladder`` (default `Ladder()`): one
    `stash_aware` step per rung, the same ``cfg`` otherwise. ``graph``: each rung's attempt
    replays from a CUDA graph (`psf.graphed`), the graphs of at most ``max_graphs`` rungs kept
    (the least recently used dropped, with the memory of its pool). Example::

        astep = psf.adaptive(loss_fn, psf.StashConfig(capacity_factor=1.25, paged_stash=True,
                                                      pool_scope="layer"))
        astate = astep.init(params, batch)
        for batch in batches:
            res, astate = astep(params, batch, astate)
    """
    return AdaptiveStep(loss_fn, cfg, ladder or Ladder(), graph, max_graphs)
