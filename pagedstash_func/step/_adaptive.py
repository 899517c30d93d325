"""`psf.adaptive`: a stash-aware step that moves over a `Ladder`'s rungs from step to step,
a state (and on CUDA a graph, or a compiled step) per rung built once and reused, its policy's
own state an explicit value saved with a step file and replayed bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..core._config import StashConfig
from ..stash._state import ConsumedStateError, StashState, StateMismatchError
from ._compile import compile as compile_step
from ._graph import GraphedStep, SharedGraphs
from ._ladder import Ladder, LadderMove, layer_needs, needed_factor
from ._runner import StepResult, attempt_step, rerun_exact
from ._transform import StashAwareStep, generator_states, restore_generators, stash_aware

__all__ = ["AdaptiveState", "AdaptiveStep", "adaptive"]

MOVES_KEPT = 1_000     # the moves an AdaptiveState (and its step file) keeps, newest last


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
