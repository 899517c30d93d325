"""An adaptive capacity factor: a fixed ladder of rungs, and a pure policy that picks each
step's rung from what `run_step` already read once (no new host reads).

Each rung is a `StashConfig` with its own ``capacity_factor``, so shapes stay static per rung.
The policy keeps the factor each recent step needed (its largest rank load over the balanced
reference, counted before any drop: the same whatever rung the step ran at). After a step that
went over budget it climbs straight to the lowest rung that would have fit it, and the step
reruns there (a capacity attempt that drops nothing; the exact path only if that one flags
too); it descends, a cooldown after its last move, to the lowest rung that would have fit all
but a ``target_rerun_rate`` share of the recent steps.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import math
import numbers
from typing import NamedTuple

import torch

from ..core._config import StashConfig
from ..stash._state import ConsumedStateError, StashState, StateMismatchError
from ._compile import compile as compile_step
from ._graph import GraphedStep, SharedGraphs
from ._runner import StepReport, StepResult, attempt_step, rerun_exact
from ._transform import StashAwareStep, generator_states, restore_generators, stash_aware

__all__ = ["AdaptiveState", "AdaptiveStep", "Ladder", "LadderMove", "adaptive"]

MIN_EVIDENCE = 10      # steps seen before the first descent
MAX_WINDOW = 10_000    # the most recent steps a descent reads (each step sorts them)
MOVES_KEPT = 1_000     # the moves an AdaptiveState (and its step file) keeps, newest last


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


def _reports_alike(state: StashState, group) -> bool:
    """Whether every rank whose flags this step reads holds the same report: one process, or
    every MoE layer expert-parallel over exactly those ranks (their loads summed there).
    `ValueError` (structural, so on every rank alike) for a step that mixes expert-parallel
    layers with layers of its own: the ranks of an expert-parallel group would then decide
    from different loads, move to different rungs and disagree on their budgets."""
    groups = state.groups
    if groups and any(info.group_size == 1 for info in state.layers):
        raise ValueError("psf.adaptive decides each step's rung from the step's loads, which "
                         "the ranks of an expert-parallel group must read alike: this step "
                         "has expert-parallel layers beside layers of one rank's own. Make "
                         "every MoE layer expert-parallel (psf.moe(..., group=G)), or use a "
                         "fixed capacity factor")
    if not groups:
        return group is None
    dist = torch.distributed
    wanted = set(dist.get_process_group_ranks(group if group is not None
                                              else next(iter(groups.values()))))
    return all(set(dist.get_process_group_ranks(g)) == wanted for g in groups.values())


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


@dataclasses.dataclass
class AdaptiveState:
    """What an adaptive loop threads.

    Everything it holds is bounded, so a step's host time does not grow with the run. A call
    uses it up (``used``): thread the one each call returns.

    Attributes:
        rung: the rung of the next step (a tuple of them with ``per_layer``).
        history: the recent needs (the window's).
        states: a `StashState` per rung built so far (each consumed by its steps as usual).
        moves: the recent moves (a tuple of `LadderMove`, one per step, oldest first: the last
            `MOVES_KEPT`; log ``astate.moves[-1]`` after each step for a longer record).
        calm: steps since the last move (the cooldown's clock).
        built_for: the ladder and config of the adaptive step that made it.
        used: whether a call has used it up.
        steps: the steps taken since ``init``.
    """

    rung: int
    history: tuple
    states: dict
    moves: tuple = ()
    calm: int = 0             # steps since the last move (the cooldown's clock)
    built_for: tuple = dataclasses.field(default=(), compare=False, repr=False)
    used: bool = dataclasses.field(default=False, compare=False, repr=False)
    steps: int = 0

    def __post_init__(self):
        if type(self.moves) is not tuple or len(self.moves) > MOVES_KEPT:
            self.moves = tuple(self.moves)[-MOVES_KEPT:]


class AdaptiveStep:
    """``res, astate = astep(params, batch, astate)``: a step at the rung the policy chose.

    An attempt at the rung the policy chose (a rerun, if flagged, at the rung that fits or on
    the exact path), then the policy's move (``astate.moves[-1]``). See `adaptive`, which makes
    one.

    Args:
        loss_fn: ``loss_fn(params, batch) -> loss | (loss, aux)``, as `stash_aware` takes it.
        cfg: the `StashConfig` of every rung but its ``capacity_factor``; no
            ``layer_factors``, and with ``paged_stash`` ``pool_scope="layer"``.
        ladder: the `Ladder`.
        graph: each rung's attempt replays from a CUDA graph.
        max_graphs: the rungs whose graphs are kept (default every rung).
        donate: as `graphed` takes it.
        copy_grads: as `graphed` takes it.
        compiled: ``True`` or a dict of ``torch.compile`` arguments: each rung's step is a
            `psf.compile` step (with ``graph``, its compiled attempt is what each rung's graph
            captures).

    Raises:
        ValueError: ``cfg`` is not a `StashConfig` or ``ladder`` not a `Ladder`, ``cfg`` sets
            ``layer_factors`` or pages with ``pool_scope="state"``, ``max_graphs`` is not a
            positive integer, or ``compiled`` is neither a bool nor a dict.
    """

    def __init__(self, loss_fn, cfg: StashConfig, ladder: Ladder, graph: bool = False,
                 max_graphs: int | None = None, donate: bool = False, copy_grads: bool = True,
                 compiled=False):
        if compiled is not False and not isinstance(compiled, (bool, dict)):
            raise ValueError(f"compiled must be True or a dict of torch.compile arguments, got "
                             f"{compiled!r}")
        # torch.compile's arguments for every rung (None: the rungs run eagerly)
        self._compile_kwargs = None if compiled is False else {} if compiled is True else \
            compiled
        if not isinstance(cfg, StashConfig):
            raise ValueError(f"cfg must be a psf.StashConfig, got {type(cfg).__name__}")
        if not isinstance(ladder, Ladder):
            raise ValueError(f"ladder must be a psf.Ladder, got {type(ladder).__name__}")
        if cfg.layer_factors:
            raise ValueError(f"psf.adaptive picks every layer's capacity factor from the ladder: "
                             f"drop layer_factors ({dict(cfg.layer_factors)}), or run fixed "
                             f"factors with psf.run_step")
        if cfg.paged_stash and cfg.pool_scope != "layer":
            raise ValueError("an adaptive step keeps a state per rung: with pool_scope='state' "
                             "each would hold its own pools between steps. Use "
                             "pool_scope='layer' (pools live only within a step) or "
                             "paged_stash=False")
        self.ladder, self.loss_fn, self.cfg = ladder, loss_fn, cfg
        self._built_for = (ladder, cfg)
        self.steps = tuple(self._step_of(dataclasses.replace(cfg, capacity_factor=r))
                           for r in ladder.rungs)
        self._layer_steps: dict = {}     # per_layer: rungs tuple -> its step (the recent kept)
        if max_graphs is None:
            max_graphs = len(ladder.rungs)
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive integer, got {max_graphs!r}")
        self.graph, self.max_graphs = bool(graph), max_graphs
        self.donate, self.copy_grads = bool(donate), bool(copy_grads)
        self._graphs: dict = {}          # rung -> GraphedStep, the most recently used kept
        self._dropped_captures = 0
        self._shared = None              # the rungs' graphs' one pool and static buffers
        self._last_graph = None          # (rung, GraphedStep) of the last call
        self._zeros = None               # the flags and counts of the rungs at rest

    def _step_of(self, cfg):
        """A rung's step: `stash_aware`, compiled by `psf.compile` where asked (a graph of its
        own per rung: each compiled step traces code of its own, so rungs never share the
        compiler's recompile limit)."""
        step = stash_aware(self.loss_fn, cfg)
        return step if self._compile_kwargs is None else \
            compile_step(step, **self._compile_kwargs)

    def init(self, params, batch) -> AdaptiveState:
        """The first `AdaptiveState`: the start rung's state, built for ``batch``.

        Args:
            params: the parameters the steps will take.
            batch: a batch of the shape the steps will take (an `AdaptiveState` serves one shape).

        Returns:
            An `AdaptiveState` at the ladder's start rung (every layer at it with ``per_layer``).

        Raises:
            ValueError: as ``step.init`` raises it.
        """
        rung = self.ladder.start if self.ladder.start is not None else len(self.ladder.rungs) - 1
        state = self.steps[rung].init(params, batch)
        if self.ladder.per_layer:          # every layer at the start rung: the same shapes
            if not state.layers:
                raise ValueError("Ladder(per_layer=True) gives each MoE layer a rung of its "
                                 "own, but this loss calls psf.moe nowhere: nothing to adapt "
                                 "(use psf.run_step, or call psf.moe in the loss)")
            rung = (rung,) * len(state.layers)
        return AdaptiveState(rung, (), {rung: state}, built_for=self._built_for)

    def step_at(self, rung):
        """The `stash_aware` step of ``rung``.

        Args:
            rung: a rung index; with ``per_layer``, a tuple of them: its layers' factors as
                `StashConfig.layer_factors`.

        Returns:
            The `StashAwareStep` of that rung.
        """
        if not isinstance(rung, tuple):
            return self.steps[rung]
        if len(set(rung)) == 1:
            return self.steps[rung[0]]
        step = self._layer_steps.pop(rung, None)
        if step is None:
            factors = {f"moe{i}": self.ladder.rungs[r] for i, r in enumerate(rung)}
            step = self._step_of(dataclasses.replace(
                self.cfg, capacity_factor=self.ladder.rungs[max(rung)],
                layer_factors=factors))
        self._layer_steps[rung] = step
        while len(self._layer_steps) > self.max_graphs:       # the least recent dropped
            self._layer_steps.pop(next(iter(self._layer_steps)))
        return step

    def __call__(self, params, batch, astate: AdaptiveState, **kwargs) -> tuple[StepResult,
                                                                             AdaptiveState]:
        # the host path of every step: kept short (on a step bound by launches, a graphed
        # replay of about a millisecond, each microsecond here is a thousandth of the step);
        # what needs no flag runs while the attempt runs on the device (`ahead`)
        """One step at the rung ``astate`` holds, then the policy's move.

        Args:
            params: the parameters.
            batch: a batch of the shape ``astate``'s states were built for.
            astate: the `AdaptiveState` from ``init`` or the previous call; used up.
            **kwargs: ``argnums`` and ``group``, as `run_step` takes them.

        Returns:
            ``(res, next_astate)``: the `StepResult` (``report.reran`` true if it reran) and the
                `AdaptiveState` to thread on.

        Raises:
            TypeError: ``astate`` is not an `AdaptiveState`.
            ValueError: ``astate`` comes from another adaptive step (another ladder or config),
                or the step mixes expert-parallel layers with layers of one rank's own.
            ConsumedStateError: ``astate`` was used by an earlier call.
            StateMismatchError: a batch of another shape (the message advises an
                `AdaptiveState` per shape).
        """
        self._check_state(astate, "the third argument")
        rung = astate.rung
        states = dict(astate.states)
        generators = () if self.graph else generator_states(batch)   # graphs: tensors only
        ready = []

        def ahead(new_state):           # before the flag read waits for the device
            ready.append(_reports_alike(new_state, kwargs.get("group")))
            if not self.ladder.per_layer:
                ready.append(self.ladder.prepare(rung, astate.history, astate.calm))

        try:
            res = self._attempt(rung, params, batch, states, False, kwargs, ahead)
        except StateMismatchError as err:
            if err.shape:
                raise _advised(err) from err
            raise
        astate.used = True
        report, rerun = res.report, ""
        ran = (rung,)                                # the rungs whose attempts ran
        alike = ready[0]
        if report.over_budget or report.overflow:
            up, fits = self._fitting(rung, report)
            restore_generators(generators)           # the rerun draws what the attempt drew
            # at a rung only where it is exact and every rank of the flags takes it too:
            # ranks whose reports differ take the exact path, each on its own
            if report.overflow or not fits or not alike \
                    or self.cfg.stash_precision != "same":
                grads, loss, aux = rerun_exact(self.step_at(rung), params, batch,
                                               kwargs.get("argnums", 0), res.aux is not None)
                res, rerun = dataclasses.replace(res, grads=grads, loss=loss, aux=aux), "exact"
            else:                # a rung that fits: it drops nothing (else it reruns exact)
                again = self._attempt(up, params, batch, states, True, kwargs, None, True)
                ran = (rung, up)
                rerun = "exact" if again.report.reran else f"cf {self.factor_of(up)}"
                res = dataclasses.replace(again, state=res.state)
            res = dataclasses.replace(res, report=dataclasses.replace(report, reran=True))
        if self.ladder.per_layer:
            nxt, history, move = self.ladder.decide_layers(rung, astate.history, report,
                                                           astate.calm)
            self._keep_recent(states, nxt)
        else:
            nxt, history, move = ready[1].after(report)
        if rerun:
            move = move._replace(rerun=rerun)
        for key in ran:                              # a rung left: its state at rest
            if key != nxt and key in states:
                states[key] = self._at_rest(states[key])
        return res, AdaptiveState(nxt, history, states, astate.moves[1 - MOVES_KEPT:] + (move,),
                                  0 if nxt != rung else astate.calm + 1, self._built_for,
                                  steps=astate.steps + 1)

    def _check_state(self, astate, what: str) -> None:
        """``astate`` must be this step's: an `AdaptiveState` whose rung indexes this ladder
        (a tuple of them with ``per_layer``), its rung's state not used by an earlier call."""
        if type(astate) is AdaptiveState and astate.built_for is self._built_for \
                and not astate.used and not self.ladder.per_layer:    # the usual: one call's
            rung = astate.rung
            if type(rung) is int and 0 <= rung < len(self.steps):
                state = astate.states.get(rung)
                if state is None or not state.consumed or state.failed:
                    return
        if not isinstance(astate, AdaptiveState):
            raise TypeError(f"{what} must be the AdaptiveState from astep.init (or the one the "
                            f"previous call returned), got {type(astate).__name__}")
        if astate.built_for and astate.built_for != self._built_for:
            raise ValueError("this AdaptiveState comes from another adaptive step (another "
                             "ladder or config): its rungs' states were built for that one's "
                             "budgets. Build it with this step's init(params, batch)")
        rung, top = astate.rung, len(self.ladder.rungs)
        if self.ladder.per_layer:
            ok = isinstance(rung, tuple) and bool(rung) and all(
                type(r) is int and 0 <= r < top for r in rung)
        else:
            ok = type(rung) is int and 0 <= rung < top
        if not ok:
            kind = "a tuple of indices, one per MoE layer," if self.ladder.per_layer \
                else "one index"
            raise ValueError(f"this AdaptiveState's rung {rung!r} is not {kind} into this "
                             f"ladder's {top} rungs (per_layer={self.ladder.per_layer}): it "
                             f"comes from another adaptive step. Build it with this step's "
                             f"init(params, batch)")
        if self.ladder.per_layer and astate.states:
            layers = len(next(iter(astate.states.values())).layers)
            if len(rung) != layers:
                raise ValueError(f"this AdaptiveState holds a rung for {len(rung)} MoE layers "
                                 f"where its states have {layers}: it comes from another "
                                 f"adaptive step. Build it with this step's init(params, batch)")
        state = astate.states.get(rung)
        if astate.used or (state is not None and state.consumed and not state.failed):
            raise ConsumedStateError(_USED)

    def _fitting(self, rung, report):
        """``(rung to rerun at, whether it fits)``: the lowest rung at or above the step's
        need (per layer with ``per_layer``); it fits when it is above ``rung`` (some layer
        climbs) and no layer needs more than the top rung."""
        if not self.ladder.per_layer:
            needed = needed_factor(report)
            up = self.ladder.fitting_rung(needed)
            return up, up > rung and self.ladder.rungs[up] >= needed
        needs = layer_needs(report)
        up = tuple(max(r, self.ladder.fitting_rung(n)) for r, n in zip(rung, needs))
        fits = len(needs) == len(rung) and up != rung and all(
            self.ladder.rungs[u] >= n for u, n in zip(up, needs))
        return up, fits

    def _keep_recent(self, states, current) -> None:
        """With a rung per layer, the states of at most ``max_graphs`` rung tuples kept (the
        least recently used dropped; a dropped one is built again on its next visit)."""
        if current in states:
            states[current] = states.pop(current)
        while len(states) > self.max_graphs:
            del states[next(iter(states))]

    def _at_rest(self, state: StashState) -> StashState:
        """``state`` with the flags and routing counts that every rung's state shares while
        its rung does not run: zeros that nothing writes (a step clears them before it
        writes its own), one set for the ladder rather than one a rung."""
        zeros = self._zeros
        if zeros is None or not _same_figures(zeros, state):
            zeros = self._zeros = (torch.zeros_like(state.flags),
                                   {k: torch.zeros_like(v) for k, v in state.counts.items()})
        return state.successor(flags=zeros[0], counts=dict(zeros[1]))

    def factor_of(self, rung):
        """The capacity factor of ``rung``.

        Args:
            rung: a rung index, or a tuple of them.

        Returns:
            The factor (a tuple of factors for a tuple of rungs).
        """
        if isinstance(rung, tuple):
            return tuple(self.ladder.rungs[r] for r in rung)
        return self.ladder.rungs[rung]

    def _attempt(self, rung, params, batch, states, rerun, kwargs, while_waiting=None,
                 again=False):
        """One attempt at ``rung`` (its state from ``states``, built on a first visit, and the
        next one put back there); ``rerun`` as `attempt_step` takes it, ``kwargs`` (a dict)
        the call's, ``while_waiting`` as `finish_step` takes it; ``again``: the call's second
        attempt, whose params and batch the first one copied into the graphs' shared buffers
        already."""
        step = self.step_at(rung)
        state = states.pop(rung, None)
        if state is None:                 # first visit: its state, built for this batch
            state = step.init(params, batch)
            _check_alike(state, states)
        if self.graph:
            res = self._graph(rung).attempt(params, batch, state, rerun=rerun,
                                            while_waiting=while_waiting, inputs_copied=again,
                                            **kwargs)
        else:
            res = attempt_step(step, params, batch, state, rerun=rerun,
                               while_waiting=while_waiting, **kwargs)
        states[rung] = res.state
        return res

    def warm(self, params, batch, astate: AdaptiveState) -> AdaptiveState:
        """Build every rung's state now and, with ``graph=True``, capture every rung's graph.

        Graphs are captured up to ``max_graphs``, so that no step of the run pays for a first
        visit (a state's recording pass; two warm-up attempts and a capture).

        Args:
            params: the parameters the steps will take.
            batch: a batch of the shape the steps will take.
            astate: the `AdaptiveState` to go on from (not used up).

        Returns:
            The state to go on with (the same policy state).

        Raises:
            StateMismatchError: a batch of another shape than ``astate``'s states.
        """
        self._check_state(astate, "warm's astate")
        states = dict(astate.states)
        keys = list(range(len(self.steps)))
        if self.ladder.per_layer:       # the ladder's own rungs, every layer alike
            keys = [(r,) * len(astate.rung) for r in keys]
        graphed = sorted(keys, key=lambda r: r == astate.rung)[-self.max_graphs:] \
            if self.graph else []                 # the current rung's and the highest others
        # the highest rung first: its state's recording pass and its graph's warm-ups take
        # the most memory, and no other rung's graph (nor any state but the first call's) is
        # held yet then
        with _per_shape_advice():
            for key in reversed(keys):
                if key not in states:
                    state = self.step_at(key).init(params, batch)
                    _check_alike(state, states)
                    states[key] = self._at_rest(state)
                if key in graphed:
                    self._graph(key).prepare(params, batch, states[key])
        if astate.rung in graphed:
            self._graph(astate.rung)              # the most recently used: dropped last
        return dataclasses.replace(astate, states=states)

    def _graph(self, rung):
        """The rung's graphed step (at most ``max_graphs`` rungs' graphs kept, the least
        recently used dropped). The rungs' graphs share one memory pool, so that their
        temporaries overlap, and one set of static params and batch buffers (`SharedGraphs`)."""
        if self._last_graph is not None and self._last_graph[0] == rung:
            return self._last_graph[1]                      # the most recent already
        runner = self._graph_lookup(rung)
        self._last_graph = (rung, runner)
        return runner

    def _graph_lookup(self, rung):
        if self._shared is None:
            self._shared = SharedGraphs()
        runner = self._graphs.pop(rung, None) or GraphedStep(
            self.step_at(rung), donate=self.donate, copy_grads=self.copy_grads,
            _shared=self._shared)
        self._graphs[rung] = runner                         # most recent last
        while len(self._graphs) > self.max_graphs:
            oldest = self._graphs.pop(next(iter(self._graphs)))
            self._dropped_captures += oldest.captures
            oldest.clear()
        return runner

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far (with ``graph=True``): one per rung visited, and one
        more each time a rung whose graph was dropped (``max_graphs``) is visited again."""
        return self._dropped_captures + sum(g.captures for g in self._graphs.values())

    def save_step(self, path, params, batch, astate: AdaptiveState, **kwargs) -> None:
        """`psf.save_step` of the next step (at ``astate``'s rung) with the policy's state.

        The file holds the rung, history and moves: `load` resumes the run from it,
        `psf.replay_step` replays that one step.

        Args:
            path: the file to write.
            params: the parameters of the next step.
            batch: the batch of the next step.
            astate: the `AdaptiveState` the next step will take (not used up).
            **kwargs: ``check_loss_fn``, as `psf.save_step` takes it.

        Raises:
            ConsumedStateError: ``astate`` was used by an earlier call.
            ValueError: as `psf.save_step` refuses its inputs.
        """
        from ._replay import save_step
        self._check_state(astate, "save_step's astate")
        state = astate.states.get(astate.rung)
        if state is None:
            state = self.step_at(astate.rung).init(params, batch)
            astate.states[astate.rung] = state
        policy = {"rungs": list(self.ladder.rungs), "per_layer": self.ladder.per_layer,
                  "knobs": _knobs(self.ladder),
                  "rung": _listed(astate.rung), "history": [_listed(h) for h in astate.history],
                  "moves": [[_listed(x) for x in m] for m in astate.moves],
                  "calm": astate.calm, "steps": astate.steps}
        save_step(path, self.step_at(astate.rung), params, batch, state, policy=policy,
                  **kwargs)

    def load(self, path, loss_fn, **kwargs) -> tuple:
        """``(params, batch, astate)`` from a file of `save_step`.

        The run resumes with the policy where it was (the rung's state from the file; other rungs'
        states are built again when visited).

        Args:
            path: the file `save_step` wrote.
            loss_fn: the loss the file was saved with.
            **kwargs: ``device`` and ``check_loss_fn``, as `psf.load_step` takes them.

        Returns:
            ``(params, batch, astate)``, ``astate`` an `AdaptiveState` of this step.

        Raises:
            ValueError: a file of another ladder (other rungs, ``per_layer`` or knobs), a
                malformed policy entry, or what `psf.load_step` refuses.
        """
        from ._replay import load_policy, load_step
        policy = load_policy(path)
        if not isinstance(policy, dict) or policy.get("rungs") != list(self.ladder.rungs):
            raise ValueError(f"{path} was not saved by an adaptive step of this ladder "
                             f"({self.ladder.rungs})")
        if bool(policy.get("per_layer", False)) != self.ladder.per_layer:
            raise ValueError(f"{path} was saved by a ladder with per_layer="
                             f"{bool(policy.get('per_layer', False))}; this one has "
                             f"per_layer={self.ladder.per_layer}")
        knobs = policy.get("knobs")
        if knobs is not None and knobs != _knobs(self.ladder):
            raise ValueError(f"{path} was saved by a ladder with {knobs}; this one has "
                             f"{_knobs(self.ladder)}: its moves would not be this ladder's. "
                             f"Load it with a Ladder of those settings")
        _, params, batch, state = load_step(path, loss_fn, **kwargs)
        each = (lambda f, x: tuple(f(v) for v in x)) if self.ladder.per_layer else \
            (lambda f, x: f(x))
        try:
            rung = each(int, policy["rung"])
            history = tuple(each(float, h) for h in policy["history"][-self.ladder.steps_seen:])
            moves = tuple(LadderMove(each(int, a), each(int, b), each(float, n), str(w),
                                     *map(str, rest))
                          for a, b, n, w, *rest in policy["moves"][-MOVES_KEPT:])
        except (TypeError, ValueError, KeyError):
            raise ValueError(f"{path}: a malformed move in its policy entry") from None
        steps = policy.get("steps")
        if not isinstance(steps, int) or steps < len(moves):      # an older file: every move
            steps = len(policy["moves"])
        calm = policy.get("calm")
        if not isinstance(calm, int):            # an older file: steps since the last move
            calm = 0
            for m in reversed(moves):
                if m.rung != m.next_rung:
                    break
                calm += 1
        return params, batch, AdaptiveState(rung, history, {rung: state}, moves, calm,
                                            self._built_for, steps=steps)

    def replay(self, path, loss_fn, *, group=None, **kwargs) -> tuple[StepResult,
                                                                      AdaptiveState]:
        """The step of a file of `save_step` run again as this ladder runs it.

        A rerun at the rung it climbs to included: the bits and move of the run that saved it,
        when that run followed this rule. `psf.replay_step` replays the file as `run_step` would run
        it (a rerun on the exact path).

        Args:
            path: the file `save_step` wrote.
            loss_fn: the loss the file was saved with.
            group: as `run_step` takes it.
            **kwargs: as `load` takes them.

        Returns:
            ``(res, astate)``, as a call returns them.
        """
        params, batch, astate = self.load(path, loss_fn, **kwargs)
        return self(params, batch, astate, group=group)

    def factor(self, astate: AdaptiveState):
        """The capacity factor the next call runs at (with ``per_layer``, one per layer).

        Args:
            astate: the `AdaptiveState` the next call takes.

        Returns:
            A float, or a tuple of floats with ``per_layer``.
        """
        return self.factor_of(astate.rung)


_USED = """This AdaptiveState was already used by an earlier call (its rung's StashState is
consumed). Thread the state each call returns:

    res, astate = astep(params, batch, astate)

To run twice from one point on purpose, save it first (astep.save_step) and load it back."""

_PER_SHAPE = ("psf.adaptive builds its rungs' states for one batch shape: keep an "
              "AdaptiveState per shape (e.g. per bucket of psf.pad_rows: astates[size] = "
              "astep.init(params, padded) on a bucket's first batch), each threaded on its own")


def _knobs(ladder: Ladder) -> dict:
    """The settings besides the rungs that a ladder's moves depend on (a step file's)."""
    return {"target_rerun_rate": ladder.target_rerun_rate, "window": ladder.steps_seen,
            "cooldown": ladder.calm_steps, "start": ladder.start}   # Python numbers (Ladder)


def _check_alike(state: StashState, states: dict) -> None:
    """A rung's state built on its first visit must be for the token counts of the others
    (`StateMismatchError` naming an AdaptiveState per batch shape, before it runs)."""
    other = next(iter(states.values()), None)
    if other is None:
        return
    now, then = ([info.tokens for info in s.layers] for s in (state, other))
    if now != then:
        raise StateMismatchError(f"this batch gives the MoE layers {now} tokens where this "
                                 f"AdaptiveState's states were built for {then}", shape=True)


def _same_figures(zeros, state: StashState) -> bool:
    """Whether ``zeros`` (flags, counts) are shaped like ``state``'s flags and counts."""
    flags, counts = zeros
    return counts.keys() == state.counts.keys() and all(
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        for a, b in [(flags, state.flags)] + [(counts[k], state.counts[k]) for k in counts])


def _advised(err: StateMismatchError) -> StateMismatchError:
    """A `StateMismatchError` over the batch's token count with the advice to keep an
    AdaptiveState per batch shape (raise it from ``err``)."""
    return StateMismatchError(f"{err}\n{_PER_SHAPE}", shape=True)


@contextlib.contextmanager
def _per_shape_advice():
    """`_advised` around a block: a `StateMismatchError` over the batch's token count raised
    inside is re-raised with the advice (the cause kept)."""
    try:
        yield
    except StateMismatchError as err:
        if err.shape:
            raise _advised(err) from err
        raise


def _as_float(x) -> float:
    """A number as a float; a numpy float32 as the decimal it prints as (``1.1``, not the
    ``1.100000023841858`` of its binary value, which would shift a budget by a row)."""
    if isinstance(x, (int, float)):
        return float(x)
    return float(str(x)) if hasattr(x, "item") else float(x)


def _listed(x):
    """A tuple as a list (a step file's policy holds lists), anything else as it is."""
    return list(x) if isinstance(x, tuple) else x


def adaptive(loss_fn, cfg: StashConfig, ladder: Ladder | None = None, *, graph: bool = False,
             max_graphs: int | None = None, donate: bool = False,
             copy_grads: bool = True, compiled=False) -> AdaptiveStep:
    """A step whose capacity factor follows ``ladder``: one `stash_aware` step per rung.

    The rungs share ``cfg`` but for the capacity factor. The rungs' graphs share one memory pool
    and one set of static buffers, so a graph per rung costs little beyond the largest one (each
    rung's page tables: see `SharedGraphs`). `AdaptiveStep.warm` captures them all before a
    run.

    Args:
        loss_fn: ``loss_fn(params, batch) -> loss | (loss, aux)``, as `stash_aware` takes it.
        cfg: the `StashConfig` of every rung but its ``capacity_factor``.
        ladder: the `Ladder` (default `Ladder()`).
        graph: each rung's attempt replays from a CUDA graph (`psf.graphed`).
        max_graphs: the graphs of at most this many rungs kept (default every rung; the least
            recently used dropped).
        donate: as `psf.graphed` takes it.
        copy_grads: as `psf.graphed` takes it.
        compiled: ``True``, or a dict of ``torch.compile`` arguments: each rung's attempt
            runs as a `psf.compile` step (compiled at its first use; with ``graph``, compiled
            in the warm-ups before its capture).

    Returns:
        An `AdaptiveStep`.

    Raises:
        TypeError: ``loss_fn`` is a step (`psf.stash_aware`, `psf.compile`), not a loss.
        ValueError: as `AdaptiveStep` refuses its arguments.

    Example::

        astep = psf.adaptive(loss_fn, psf.StashConfig(capacity_factor=1.25, paged_stash=True,
                                                      pool_scope="layer"))
        astate = astep.init(params, batch)
        for batch in batches:
            res, astate = astep(params, batch, astate)
    """
    if isinstance(loss_fn, StashAwareStep):
        raise TypeError("psf.adaptive takes the loss (loss_fn(params, batch)), not a step: it "
                        "makes a step per rung itself. Pass step.loss_fn (an adaptive step is "
                        "not compiled by psf.compile)")
    return AdaptiveStep(loss_fn, cfg, ladder or Ladder(), graph, max_graphs, donate,
                        copy_grads, compiled)
