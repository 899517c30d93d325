"""The policy of an adaptive capacity factor: a fixed ladder of rungs, and a pure function
that picks each step's rung from what `run_step` already read once (no new host reads).

Each rung is a `StashConfig` with its own ``capacity_factor``, so shapes stay static per rung.
The policy keeps the factor each recent step needed (its largest rank load over the balanced
reference, counted before any drop: the same whatever rung the step ran at). After a step that
went over budget it climbs straight to the lowest rung that would have fit it, and the step
reruns there (a capacity attempt that drops nothing; the exact path only if that one flags
too); it descends, a cooldown after its last move, to the lowest rung that would have fit all
but a ``target_rerun_rate`` share of the recent steps. `_adaptive` runs a step on it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import numbers
from typing import NamedTuple

from ._runner import StepReport

__all__ = ["Ladder", "LadderMove"]

MIN_EVIDENCE = 10      # steps seen before the first descent
MAX_WINDOW = 10_000    # the most recent steps a descent reads (each step sorts them)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The rungs (capacity factors, increasing) and the policy's knobs.

    The rule: after a step over budget, climb to the lowest rung at or above the factor it
    needed (at least one rung, unless it is at the top or needed no more than its own rung:
    another rank's flag); otherwise, once ``MIN_EVIDENCE`` steps are seen (a whole
    window, if it is shorter) and a cooldown has passed since the last move, go down to the
    lowest rung that would have fit all but ``floor(target * n)`` of the ``n`` recent steps
    (all of them while ``n`` is below ``1 / target``). The history is not cleared by a move: a
    step's need does not depend on the rung it ran at.

    With ``per_layer=True`` each layer that went over its budget climbs to the rung that would
    have fit it; the descent lowers layers, in call order, each to the lowest rung at which all
    but ``floor(target * n)`` of the recent steps would still have fit every layer (so the steps
    that would rerun are counted once, whichever layers they overflow).

    Attributes:
        rungs: the capacity factors, > 0 and strictly increasing.
        target_rerun_rate: the share of steps that may rerun for over budget, in ``(0, 1)``.
        window: how many recent steps the descent reads (default ``ceil(1 / target)``, at
            least 10: the fewest steps in which "all but that share fit" says anything; at most
            `MAX_WINDOW`, so a target below ``1 / MAX_WINDOW`` needs an explicit ``window``).
        start: the rung of the first step (default the top one, which reruns least while
            nothing is known).
        cooldown: steps after a move before the next descent (default a fifth of the window,
            at least 5; at most `MAX_WINDOW`).
        per_layer: give each MoE layer a rung of its own (layers differ in skew): a rung is
            then a tuple, one index per layer in call order, and a step's need one factor per
            layer (`decide_layers`).

    Raises:
        ValueError: rungs that are not positive and strictly increasing, a
            ``target_rerun_rate`` outside ``(0, 1)``, a ``window`` or ``cooldown`` that is not
            a positive integer up to `MAX_WINDOW`, a default window beyond it, a ``start`` that
            indexes no rung, or a ``per_layer`` that is not a bool.
    """

    rungs: tuple = (1.0, 1.1, 1.25, 1.5, 2.0)
    target_rerun_rate: float = 0.02
    window: int | None = None
    start: int | None = None
    cooldown: int | None = None
    per_layer: bool = False

    def __post_init__(self):
        rungs = tuple(self.rungs)
        if not rungs or any(not isinstance(r, numbers.Real) or isinstance(r, bool)
                            or not math.isfinite(r) or r <= 0 for r in rungs) \
                or list(rungs) != sorted(set(rungs)):
            raise ValueError(f"Ladder(rungs={self.rungs!r}): capacity factors > 0, strictly "
                             f"increasing, e.g. (1.0, 1.1, 1.25, 1.5, 2.0)")
        object.__setattr__(self, "rungs", tuple(_as_float(r) for r in rungs))
        rate = self.target_rerun_rate
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not 0 < rate < 1:
            raise ValueError(f"Ladder(target_rerun_rate={rate!r}) must be in (0, 1)")
        object.__setattr__(self, "target_rerun_rate", _as_float(rate))
        for name in ("window", "cooldown", "start"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or \
                    value < (0 if name == "start" else 1):
                raise ValueError(f"Ladder({name}={value!r}) must be a "
                                 f"{'rung index' if name == 'start' else 'positive integer'}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.per_layer, bool):
            raise ValueError(f"Ladder(per_layer={self.per_layer!r}) must be True or False")
        for name in ("window", "cooldown"):
            value = getattr(self, name)
            if value is not None and value > MAX_WINDOW:
                raise ValueError(f"Ladder({name}={value}) exceeds {MAX_WINDOW} steps: each step "
                                 f"reads and keeps that many needs (pass at most {MAX_WINDOW})")
        if self.window is None and math.ceil(1 / self.target_rerun_rate) > MAX_WINDOW:
            raise ValueError(
                f"Ladder(target_rerun_rate={rate!r}) would read a window of "
                f"{math.ceil(1 / self.target_rerun_rate):.3g} steps (1 / target) before it could "
                f"descend: pass a target of at least {1 / MAX_WINDOW:g}, or an explicit window "
                f"(at most {MAX_WINDOW} steps; with a target below 1 / window, no step of the "
                f"window may rerun)")
        if self.start is not None and not self.start < len(rungs):
            raise ValueError(f"Ladder(start={self.start!r}) must index one of the "
                             f"{len(rungs)} rungs")

    @functools.cached_property
    def steps_seen(self) -> int:
        return self.window or max(MIN_EVIDENCE, math.ceil(1 / self.target_rerun_rate))

    @functools.cached_property
    def calm_steps(self) -> int:
        return self.cooldown or max(5, self.steps_seen // 5)

    def fitting_rung(self, needed: float) -> int:
        """The lowest rung at or above ``needed`` (the top one if none is).

        Args:
            needed: a capacity factor a step needed.

        Returns:
            A rung index.
        """
        if not needed <= self.rungs[-1]:                 # above the top (or not a number)
            return len(self.rungs) - 1
        return bisect.bisect_left(self.rungs, needed)

    def quantile_rung(self, history: tuple) -> int:
        """The lowest rung that would have fit all but ``floor(target * n)`` of the ``n`` steps.

        That is the lowest rung at or above the ``n - floor(target * n)``-th smallest need in
        ``history``.

        Args:
            history: the factors the ``n`` recent steps needed.

        Returns:
            A rung index (0 when no step has to fit, or there is none).
        """
        allowed = self.allowed(len(history))
        if allowed >= len(history):                   # none has to fit (or there is none)
            return 0
        return self.fitting_rung(sorted(history)[len(history) - 1 - allowed])

    def allowed(self, n: int) -> int:
        """``floor(target * n)``: how many of ``n`` steps may rerun.

        ``0.29 * 100`` is 29, not the 28 a float product would floor to.

        Args:
            n: a number of steps.

        Returns:
            The number of steps that may rerun.
        """
        return math.floor(self.target_rerun_rate * n + 1e-9)

    def decide(self, rung: int, history: tuple, report: StepReport, since_move: int = 0):
        """``(next rung, history, LadderMove)`` after a step at ``rung`` with ``report``.

        A pure function of its arguments. The same as
        ``prepare(rung, history, since_move).after(report)``.

        Args:
            rung: the index of the rung the step ran at.
            history: the factors recent steps needed.
            report: the step's `StepReport`.
            since_move: steps after the last move (this one not counted).

        Returns:
            ``(next rung, history, move)``: the rung of the next step, the history with this
                step's need (the window's), and the `LadderMove`.

        Raises:
            ValueError: ``rung`` is not one of this ladder's rungs.
        """
        return self.prepare(rung, history, since_move).after(report)

    def prepare(self, rung: int, history: tuple, since_move: int = 0) -> "Prepared":
        """The part of `decide` that needs no report, done ahead.

        `Prepared.after` then decides from the step's report in a few comparisons. `psf.adaptive`
        calls this while the GPU runs the step's attempt, before the one flag read, so that what
        the policy costs on the host stays off the time between that read and the next launch.

        Args:
            rung: the index of the rung the step runs at.
            history: the factors recent steps needed.
            since_move: steps after the last move (this one not counted).

        Returns:
            A `Prepared`, whose ``after(report)`` gives `decide`'s answer.

        Raises:
            ValueError: ``rung`` is not one of this ladder's rungs.
        """
        if type(rung) is not int or not 0 <= rung < len(self.rungs):
            raise ValueError(f"rung {rung!r} is not one of this ladder's {len(self.rungs)} "
                             f"rungs (an AdaptiveState from another ladder?)")
        return Prepared(self, rung, history, since_move)

    def decide_layers(self, rungs: tuple, history: tuple, report: StepReport,
                      since_move: int = 0):
        """`decide` with a rung per layer (``per_layer=True``).

        A pure function of its arguments.

        Args:
            rungs: the rung of each MoE layer of the step, one index per layer, in call order.
            history: each recent step's need per layer.
            report: the step's `StepReport`.
            since_move: steps after the last move (this one not counted).

        Returns:
            ``(next rungs, history, LadderMove)`` after a step at ``rungs``.

        Raises:
            ValueError: ``rungs`` is not a tuple of indices into this ladder's rungs, or the step
                ran another number of MoE layers than ``rungs`` holds.
        """
        top = len(self.rungs) - 1
        if not isinstance(rungs, tuple) or not all(type(r) is int and 0 <= r <= top
                                                   for r in rungs):
            raise ValueError(f"rungs {rungs!r} are not one index per layer into this ladder's "
                             f"{len(self.rungs)} rungs (an AdaptiveState from another ladder?)")
        needs = layer_needs(report)
        if len(needs) != len(rungs):
            raise ValueError(f"the step ran {len(needs)} MoE layers where the ladder's state "
                             f"holds a rung for {len(rungs)}: a state per layer count")
        history = (history + (needs,))[-self.steps_seen:]
        factors = [self.rungs[r] for r in rungs]
        if report.over_budget:
            over = [i for i, (n, f) in enumerate(zip(needs, factors)) if n > f]
            up = tuple(min(top, max(r + 1, self.fitting_rung(n))) if i in over else r
                       for i, (r, n) in enumerate(zip(rungs, needs)))
            why = f"over budget: climb layers {over} to the rungs that would have fit" \
                if up != rungs else "over budget at the top rung: stay" if over else \
                "over budget elsewhere (another rank's flag): stay"
            return up, history, LadderMove(rungs, up, needs, why)
        evidence = min(MIN_EVIDENCE, self.steps_seen)
        if any(rungs) and len(history) >= evidence and since_move + 1 >= self.calm_steps:
            allowed = self.allowed(len(history))
            over = [{s for s, h in enumerate(history) if h[i] > f}     # at the rungs now
                    for i, f in enumerate(factors)]
            missed: set = set()           # steps that would rerun at the layers fixed so far
            down = []
            for i, r in enumerate(rungs):
                later = set().union(*over[i + 1:])       # the layers not yet lowered
                for cand in range(r + 1):
                    extra = {s for s, h in enumerate(history) if h[i] > self.rungs[cand]}
                    if len(missed | extra | later) <= allowed or cand == r:   # else: stay
                        missed |= extra
                        down.append(cand)
                        break
            down = tuple(down)
            if down != rungs:
                return down, history, LadderMove(
                    rungs, down, needs, f"the rungs would have fit "
                                        f"{len(history) - len(missed)} of the last "
                                        f"{len(history)} steps")
        return rungs, history, LadderMove(rungs, rungs, needs, "stay")


class Prepared:
    """`Ladder.decide` for one step with its report still to come: what the window and the
    cooldown say is worked out here (the recent needs that stay in the window, sorted, and the
    two of them that bound its quantile), so that `after` decides from the step's need by a
    clamp and two binary searches."""

    __slots__ = ("ladder", "rung", "kept", "calm", "ranked", "low", "high")

    def __init__(self, ladder: Ladder, rung: int, history: tuple, since_move: int):
        self.ladder, self.rung = ladder, rung
        stay = ladder.steps_seen - 1                  # the window's steps before this one
        self.kept = tuple(history[len(history) - stay:] if len(history) > stay else history)
        n = len(self.kept) + 1
        evidence = min(MIN_EVIDENCE, ladder.steps_seen)   # a window set below it: a full one
        self.calm = rung > 0 and n >= evidence and since_move + 1 >= ladder.calm_steps
        self.ranked, self.low, self.high = (), -math.inf, math.inf
        if self.calm:
            # the descent reads the j-th smallest of the n needs with this step's: with the
            # others sorted (s), that is this step's need clamped to [s[j - 1], s[j]]
            self.ranked = sorted(self.kept)
            j = n - 1 - ladder.allowed(n)
            if j < 0:                                 # every step may rerun: the lowest rung
                self.high = -math.inf
            if j > 0:
                self.low = self.ranked[j - 1]
            if 0 <= j < len(self.ranked):
                self.high = self.ranked[j]

    def after(self, report: StepReport):
        """``(next rung, history, LadderMove)``: `Ladder.decide`'s answer for ``report``."""
        ladder, rung = self.ladder, self.rung
        rungs = ladder.rungs
        needed = needed_factor(report)
        history = self.kept + (needed,)
        if report.over_budget:
            up = max(rung + 1, ladder.fitting_rung(needed)) if needed > rungs[rung] else rung
            up = min(up, len(rungs) - 1)
            why = "over budget: climb to the rung that would have fit" if up > rung else \
                "over budget at the top rung: stay" if needed > rungs[rung] else \
                "over budget elsewhere (another rank's flag): stay"
            return up, history, LadderMove(rung, up, needed, why)
        if self.calm:
            down = ladder.fitting_rung(min(max(needed, self.low), self.high))
            if down < rung:
                bound = rungs[down]
                over = len(self.ranked) - bisect.bisect_right(self.ranked, bound) + \
                    (needed > bound)
                return down, history, LadderMove(
                    rung, down, needed, f"the rung would have fit {len(history) - over} of "
                                        f"the last {len(history)} steps")
        return rung, history, LadderMove(rung, rung, needed, "stay")


def layer_needs(report: StepReport) -> tuple:
    """Per MoE layer of the step, in call order, the smallest capacity factor under which it
    would not have gone over budget: its largest rank load over the balanced reference."""
    needs = []
    for layer in report.layers:
        need = 0.0
        if layer.rank_load and layer.balanced_rows:
            need = max(layer.rank_load) / (layer.balanced_rows / len(layer.rank_load))
        needs.append(need)
    return tuple(needs)


class LadderMove(NamedTuple):
    """What the policy did after a step.

    Attributes:
        rung: the rung the step ran at (a tuple of them with ``per_layer``).
        next_rung: the rung of the next step.
        needed: the factor the step needed (its largest rank load over the balanced reference;
            one per layer with ``per_layer``).
        why: why the policy moved or stayed.
        rerun: where the step reran (``""``: it did not; ``"cf 1.5"``: a capacity attempt at
            that rung, which dropped nothing; ``"exact"``: the exact path).
    """

    rung: int
    next_rung: int
    needed: float
    why: str
    rerun: str = ""


def needed_factor(report: StepReport) -> float:
    """The smallest capacity factor under which no layer of the step would have gone over
    budget: the largest rank load over the balanced reference (counted before any drop)."""
    return max(layer_needs(report), default=0.0)


def _as_float(x) -> float:
    """A number as a float; a numpy float32 as the decimal it prints as (``1.1``, not the
    ``1.100000023841858`` of its binary value, which would shift a budget by a row)."""
    if isinstance(x, (int, float)):
        return float(x)
    return float(str(x)) if hasattr(x, "item") else float(x)
