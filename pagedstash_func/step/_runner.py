"""`run_step`: attempt on the capacity path, read the flags once, rerun dropless if needed.

The result a user gets is always the dropless result: capacity is a speed and memory hint,
never a change of the math.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import torch

from .. import kernels
from ..parallel._comm import all_gather_into
from ..stash._paging import reclaim
from ..stash._pools import STASHED, is_kept_whole, stashed_names
from ..stash._state import StashState
from ._grad import value_and_grad
from ._transform import StashAwareStep, generator_states, restore_generators

layout = kernels.layout


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """What one MoE layer did in one step (host values).

    Its properties derive the ratios a profile reads: ``stash_rows_needed``,
    ``expert_imbalance``, ``expert_load_ratio`` and ``load_ratio``.

    Attributes:
        name: the layer's name (``"moe0"``, ...).
        expert_load: non-padding pairs routed to each expert.
        rank_load: the same, summed per expert rank.
        rows: rows placed in the capacity buffer (stashed if stashing).
        balanced_rows: ``T * k``.
        budget: rows per rank (0 without capacity).
        capacity: rows of the capacity buffer.
        group_size: ``> 1``: real expert-parallel ranks (loads summed over them).
    """

    name: str
    expert_load: tuple[int, ...]   # non-padding pairs routed to each expert
    rank_load: tuple[int, ...]     # the same, summed per expert rank
    rows: int                      # rows placed in the capacity buffer (stashed if stashing)
    balanced_rows: int             # T * k
    budget: int                    # rows per rank (0 without capacity)
    capacity: int                  # rows of the capacity buffer
    group_size: int = 1            # > 1: real expert-parallel ranks (loads summed over them)

    @property
    def stash_rows_needed(self) -> int:
        """Rows this layer's stash needs on the busiest rank, counted before any drop: every
        non-padding pair on one device; the largest rank load across real ranks."""
        return max(self.rank_load) if self.group_size > 1 else sum(self.expert_load)

    @property
    def expert_imbalance(self) -> float:
        """The busiest expert's load over the mean expert load (1: even; 0 without pairs)."""
        mean = sum(self.expert_load) / max(1, len(self.expert_load))
        return max(self.expert_load) / mean if mean else 0.0

    @property
    def expert_load_ratio(self) -> tuple[float, ...]:
        """Each expert's load over the mean expert load."""
        mean = sum(self.expert_load) / max(1, len(self.expert_load))
        return tuple(x / mean if mean else 0.0 for x in self.expert_load)

    @property
    def load_ratio(self) -> tuple[float, ...]:
        """Each rank's load over the balanced reference ``T * k / R``."""
        ref = self.balanced_rows / max(1, len(self.rank_load))
        return tuple(x / ref if ref else 0.0 for x in self.rank_load)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Flags and statistics of one `run_step`, read in one device-to-host transfer.

    ``reasons`` lists the rerun flags that are set (``"over_budget"``, ``"overflow"``).

    Attributes:
        reran: whether the step reran on the exact path.
        over_budget: some expert rank received more pairs than its budget.
        overflow: a stash needed more pages than the pools had free.
        host_spill: pages went to the pinned host pool (reported, never a rerun).
        layers: a `LayerReport` per MoE layer, in call order.
        pages_needed: pool name (a table's name for a layer's own pool) -> pages the step's
            stashes needed at peak.
        pages_available: the same names -> ``(device pages, host pages)``.
        stash_bytes: bytes the step's stashes held: the pages they needed (a tensor kept
            whole: its buffer).
        padded_bytes: bytes the capacity-padded buffers would have kept instead.
        pool_contents: pool -> the tensors it holds.
        unconsumed: layers whose stash no backward used: `run_step` reclaimed it.
        flagged_by: ranks whose attempt raised ``over_budget`` or ``overflow``.
        kept_whole: tensors whose own pool would not have been smaller than their buffer
            (``pool_scope="layer"``): the buffer was kept, not paged.
    """

    reran: bool
    over_budget: bool
    overflow: bool
    host_spill: bool
    layers: tuple[LayerReport, ...]
    pages_needed: dict        # pool name (a table's name for a layer's own pool) -> pages
    #                           the step's stashes needed at peak
    pages_available: dict     # the same names -> (device pages, host pages)
    stash_bytes: int          # bytes the step's stashes held: the pages they needed (a
    #                           tensor kept whole: its buffer)
    padded_bytes: int         # bytes the capacity-padded buffers would have kept instead
    pool_contents: dict = dataclasses.field(default_factory=dict)  # pool -> tensors it holds
    unconsumed: tuple = ()    # layers whose stash no backward used: run_step reclaimed it
    flagged_by: tuple = ()    # ranks whose attempt raised over_budget or overflow
    kept_whole: tuple = ()    # tensors whose own pool would not have been smaller than their
    #                           buffer (pool_scope="layer"): the buffer was kept, not paged

    @property
    def reasons(self) -> list[str]:
        return [name for name in ("over_budget", "overflow") if getattr(self, name)]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What `run_step` returns.

    Attributes:
        grads: the gradients, shaped like the differentiated arguments (``argnums``).
        loss: the 0-d loss, detached.
        aux: the loss's ``aux`` (``None`` without one).
        state: the next `StashState`, flags and statistics cleared.
        report: the step's `StepReport`.
    """

    grads: object
    loss: torch.Tensor
    aux: object
    state: StashState
    report: StepReport


def run_step(step: StashAwareStep, params, batch, state: StashState, *, argnums=0,
             group=None) -> StepResult:
    """One training step with at most one rerun; gradients w.r.t. ``params`` (``argnums``).

    Attempt 1 runs ``step`` (capacity path, stash as configured) under `value_and_grad`
    (first-order ``torch.autograd.grad``: nothing kept past backward), from ``state`` with its
    flags and statistics cleared, so the report holds this attempt's figures whatever state
    came in. Then the flags and statistics cross to the host once. **Which ranks decide
    together**: the flags are reduced (any rank's flag reruns them all) over every rank the
    step communicates with, the process group of its expert-parallel layers; a step that
    communicates with no one (no ``group=`` in any `psf.moe` call) reads its own flags, whether
    or not ``torch.distributed`` is initialised, so one rank can run a step alone. Each
    expert-parallel layer's loads are summed over that layer's group. Exactness never needs
    ranks to rerun together: each rank's rerun is exact on its own. Pages of stashes that no
    backward used (an output that never reached the loss) are given back here and named in the
    report. If ``over_budget`` or ``overflow`` is set, attempt 2 runs the exact path from the
    same inputs.

    Args:
        step: a `StashAwareStep` (`stash_aware`).
        params: the parameters, any pytree of floating-point tensors the loss reads.
        batch: a batch of the shape ``state`` was built for.
        state: the live `StashState` from ``step.init`` or the previous step; consumed.
        argnums: which of ``(params, batch, state)`` to differentiate (an int or a tuple of
            them), as `value_and_grad` takes it; default ``params``.
        group: overrides the ranks that decide together: the flags are reduced over it (it
            must hold the layers' groups; a loss that itself reduces over more ranks passes
            those).

    Returns:
        A `StepResult`: the dropless ``grads``, ``loss`` and ``aux``, the next ``state`` (its
            flags and statistics cleared for the next step) and this step's ``report``.

    Raises:
        TypeError: ``step`` is not a `StashAwareStep` or ``state`` not a `StashState`.
        ValueError: a routing id outside ``[-1, E]`` seen by the capacity path (the exact
            path's error, naming the id), or a ``group`` that does not hold every layer's
            group.
        ConsumedStateError: ``state`` was consumed by an earlier call.
    """
    return attempt_step(step, params, batch, state, argnums=argnums, group=group)


def attempt_step(step: StashAwareStep, params, batch, state: StashState, *, argnums=0,
                 group=None, rerun: bool = True, while_waiting=None) -> StepResult:
    """`run_step`; with ``rerun=False`` a flagged attempt is returned as it is (its
    gradients are those of the dropped pairs' step, ``report.reran`` false and its flags
    set): for a caller that reruns on its own terms, as `AdaptiveStep` does.
    ``while_waiting(new_state)``, if given, runs on the host once the attempt is launched,
    before the flag read waits for it (`finish_step`)."""
    if not isinstance(step, StashAwareStep):
        raise TypeError(f"run_step needs a step made by psf.stash_aware(loss_fn, cfg) (or "
                        f"psf.compile of one, to compile it), got {type(step).__name__}")
    if not isinstance(state, StashState):
        raise TypeError(f"run_step needs the StashState from step.init (or from the previous "
                        f"step), got {type(state).__name__}")
    state.check_alive()
    generators = generator_states(batch)
    try:
        grads, (loss, rest) = value_and_grad(
            step.attempt, argnums=argnums, has_aux=True)(params, batch, state)
    except BaseException as err:
        if state.consumed and not state.failed:
            state.mark_failed(f"run_step, whose backward failed halfway ({type(err).__name__}"
                              f": {err}); its pools may hold pages")
        raise
    aux, new_state = rest if isinstance(rest, tuple) else (None, rest)
    return finish_step(step, params, batch, argnums, grads, loss, aux, new_state, generators,
                       state, group, rerun, while_waiting)


def finish_step(step, params, batch, argnums, grads, loss, aux, new_state, generators=(),
                given=None, group=None, rerun: bool = True, while_waiting=None) -> StepResult:
    """Everything `run_step` does after its attempt: reclaim pages no backward used, one read
    of the flags and statistics, the rerun if flagged (and ``rerun``), the report and the
    next state. ``while_waiting(new_state)``: host work of the caller's that needs no flag,
    run once the read is launched and before it is waited for (on CUDA it overlaps the
    attempt's tail on the GPU instead of delaying the next step)."""
    layer_groups = new_state.groups
    new_state, unconsumed = reclaim(new_state)
    hook = None if while_waiting is None else (lambda: while_waiting(new_state))
    host = _read_once(new_state, _flag_group(layer_groups, group), layer_groups, hook)
    if host["flags"]["bad_id"]:
        if given is not None:
            given.mark_failed("run_step, which refused a routing id outside [-1, E]")
        restore_generators(generators)
        with torch.no_grad():
            step.exact(params, batch)     # raises the ValueError that names the id
        raise ValueError("a routing id outside [-1, E] reached psf.moe in this step")
    reran = rerun and (host["flags"]["over_budget"] or host["flags"]["overflow"])
    if reran:
        restore_generators(generators)    # the rerun draws what the attempt drew
        grads, loss, aux = rerun_exact(step, params, batch, argnums, aux is not None)
    report = _report(new_state, host, reran, unconsumed)
    new_state.consume("run_step")
    return StepResult(grads=grads, loss=loss, aux=aux, state=new_state.cleared(),
                      report=report)


def rerun_exact(step, params, batch, argnums, has_aux):
    exact = value_and_grad(step.exact, argnums=argnums, has_aux=has_aux)
    if not has_aux:
        grads, loss = exact(params, batch)
        return grads, loss, None
    grads, (loss, aux) = exact(params, batch)
    return grads, loss, aux


def _flag_group(layer_groups: dict, group):
    """The group the flags are reduced over (None: this rank alone), by the one rule: the ranks
    the step communicates with, or ``group`` when the caller names one, which must hold every
    layer's group (each rank checks this locally and all raise alike)."""
    dist = torch.distributed
    by_ranks = {tuple(dist.get_process_group_ranks(g)): g for g in layer_groups.values()}
    if group is not None:
        wide = set(dist.get_process_group_ranks(group))
        short = [ranks for ranks in by_ranks if not set(ranks) <= wide]
        if short:
            raise ValueError(f"run_step(group=...) must hold every rank the step's expert-"
                             f"parallel layers exchange with; ranks {list(short[0])} are not all "
                             f"in it (its ranks: {sorted(wide)}): pass a group that spans them")
        return group
    if len(by_ranks) > 1:
        raise ValueError(f"the step's expert-parallel layers use {len(by_ranks)} process groups "
                         f"over different ranks ({[list(r) for r in by_ranks]}): pass "
                         f"run_step(..., group=G) with a group G that holds every rank they "
                         f"reach, so those ranks take the same branch")
    return next(iter(by_ranks.values())) if by_ranks else None


def _read_once(state: StashState, group=None, layer_groups=None, while_waiting=None) -> dict:
    """Flags and counters in one device-to-host copy, after one all-gather over ``group``
    (None: none, this rank's own): flags are OR-ed over its ranks; an expert-parallel layer's
    counts are summed over that layer's own group (its experts see those ranks' pairs); other
    counts stay this rank's. ``while_waiting()`` runs after the copy is launched, before it is
    waited for."""
    names = list(state.counts)
    packed = torch.cat([state.flags.to(torch.int64)] +
                       [state.counts[n].reshape(-1) for n in names])
    every, members = packed.view(1, -1), [0]
    if group is not None:
        dist = torch.distributed
        size = dist.get_world_size(group)
        every = packed.new_empty(size * packed.numel())
        all_gather_into(every, packed.contiguous(), group=group)
        every = every.view(-1, packed.numel())
        members = dist.get_process_group_ranks(group)
    rows = _to_host(every, while_waiting)
    me = members.index(torch.distributed.get_rank()) if group is not None else 0
    flags = [max(r[i] for r in rows) for i in range(layout.NUM_FLAGS)]
    out = {"flags": {n: bool(flags[i]) for i, n in enumerate(layout.FLAG_NAMES)},
           "flagged_by": tuple(members[i] for i, r in enumerate(rows)
                               if r[layout.FLAG_OVER_BUDGET] or r[layout.FLAG_OVERFLOW])}
    summed = {}        # a layer's loads -> the rows of the ranks of its own group
    for info in state.layers:
        layer_group = (layer_groups or {}).get(info.name)
        if info.group_size > 1 and layer_group is not None and group is not None:
            mine = set(torch.distributed.get_process_group_ranks(layer_group))
            summed[f"{info.name}/expert_load"] = [i for i, m in enumerate(members) if m in mine]
    at = layout.NUM_FLAGS
    for n in names:
        size = state.counts[n].numel()
        span = slice(at, at + size)
        out[n] = ([sum(col) for col in zip(*(rows[i][span] for i in summed[n]))]
                  if n in summed else rows[me][span])
        at += size
    return out


_PINNED = threading.local()       # per thread: {(shape, device): (pinned buffer, event)}


def _to_host(values: torch.Tensor, while_waiting=None) -> list:
    """``values`` (int64, small) as nested lists on the host: from a CUDA device by one copy
    into a pinned buffer of this thread's, with ``while_waiting()`` run on the host between
    launching the copy and waiting for it (a stream-ordered copy: it follows everything queued
    before it). The buffer is out of the thread's cache while its copy is in flight, so a read
    that ``while_waiting`` itself makes takes a buffer of its own."""
    if values.device.type != "cuda":
        if while_waiting is not None:
            while_waiting()
        return values.tolist()
    cache = getattr(_PINNED, "slots", None)
    if cache is None:
        cache = _PINNED.slots = {}
    key = (tuple(values.shape), values.device)
    slot = cache.pop(key, None)
    if slot is None:
        slot = (torch.empty(values.shape, dtype=values.dtype, pin_memory=True),
                torch.cuda.Event())
    host, done = slot
    try:
        host.copy_(values, non_blocking=True)
        done.record(torch.cuda.current_stream(values.device))
        if while_waiting is not None:
            while_waiting()
    finally:
        done.synchronize()                  # never left with a copy in flight
    rows = host.tolist()
    cache[key] = slot
    return rows


def _report(state: StashState, host: dict, reran: bool, unconsumed=()) -> StepReport:
    layers, rows_of = [], {}
    for info in state.layers:
        load = host[f"{info.name}/expert_load"]
        per_rank = info.num_experts // info.expert_ranks
        rank_load = tuple(sum(load[r * per_rank:(r + 1) * per_rank])
                          for r in range(info.expert_ranks))
        rows_of[info.name] = host[f"{info.name}/rows"][0]
        layers.append(LayerReport(info.name, tuple(load), rank_load, rows_of[info.name],
                                  info.balanced_rows * info.group_size, info.budget,
                                  info.capacity, info.group_size))
    pages_needed, available, contents, kept = {}, {}, {}, []
    stash_bytes = padded_bytes = 0
    # only what the layers stash (a file from before the fc1 rows were gathered again on one
    # device still has their tables, which stay empty)
    stashed = {i.name: stashed_names(i.group_size) for i in state.layers}
    # (report name, layout, tensors it serves): a shared pool serves every tensor of its
    # (dtype, width); a layer's own pool (pool_scope="layer") one tensor, under its name
    pools = [(lay.name, lay, [s for s in state.specs if (s.dtype, s.width) == lay.key])
             for lay in state.layouts]
    pools += [(name, lay, [state.spec(name)]) for name, lay in state.layer_pools.items()]
    for name, lay, served in pools:
        specs = [s for s in served
                 if s.name.removeprefix(f"{s.layer}/") in stashed.get(s.layer, STASHED)]
        contents[name] = tuple(sorted({s.name.removeprefix(f"{s.layer}/") for s in specs}))
        need = sum(math.ceil(rows_of[s.layer] / lay.page_size) for s in specs)
        padded_bytes += sum(s.capacity for s in specs) * lay.page_bytes // lay.page_size
        pages_needed[name] = need
        available[name] = (lay.cuda_pages, lay.host_pages)
        if specs and is_kept_whole(state, name):
            kept.append(name)
            stash_bytes += specs[0].capacity * lay.page_bytes // lay.page_size
        else:
            stash_bytes += need * lay.page_bytes
    flags = host["flags"]
    return StepReport(reran=reran, over_budget=flags["over_budget"], overflow=flags["overflow"],
                      host_spill=flags["host_spill"], layers=tuple(layers),
                      pages_needed=pages_needed, pages_available=available,
                      stash_bytes=stash_bytes, padded_bytes=padded_bytes,
                      pool_contents=contents, unconsumed=tuple(unconsumed),
                      flagged_by=host["flagged_by"], kept_whole=tuple(kept))
