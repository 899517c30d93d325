"""`graphed`: run_step with its attempt captured once in a CUDA graph and replayed.

A capacity attempt never reads the device on the host, so `value_and_grad` of a stash-aware
step can be captured: the first call for a set of shapes warms up on a side stream,
captures, and later calls copy the inputs into the graph's static buffers and replay it; the
one flag read follows, and a flagged attempt reruns eagerly on the exact path, as in
`run_step`.

The state is captured in place (its pools are the caller's: a state is consumed anyway). With
``donate=True`` the params are too (as JAX donates buffers), so a loop that updates its params
in place holds nothing twice; by default the graph captures copies of them. Gradients are
handed out as copies unless ``copy_grads=False``.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from ._grad import value_and_grad
from ..stash._paging import reclaim
from ._runner import StepResult, finish_step
from ..stash._state import StashState, StateMismatchError
from ._transform import StashAwareStep


class _Capture(NamedTuple):
    graph: torch.cuda.CUDAGraph
    params: object          # static inputs (the graph reads these buffers)
    batch: object
    state: StashState       # the graph's own state (its bookkeeping tensors are static)
    grads: object           # static outputs (cloned before they are handed out, by default)
    loss: torch.Tensor
    aux: object
    new_state: StashState
    released: bool = False  # grads are views of pool memory a later capture may reuse


class GraphedStep:
    """`run_step` with the attempt replayed from a CUDA graph.

    ``res = gstep(params, batch, state)``. Same inputs give the same bits as eager `run_step`
    wherever the loss's own ops pick the same kernels under capture as eagerly: psf's always
    do, and so does a `from_hf_model` loss (it keeps transformers from building a full
    attention mask under capture, which would take sdpa off its causal kernels).

    - One graph per set of shapes, dtypes and devices of ``params`` and ``batch`` (and per
      state layout), at most ``max_graphs`` kept (least recently used dropped); ``clear()``
      frees them all.
    - ``params`` may be new tensors each step or updated in place: they are copied into the
      graph's own buffers (a second copy of every parameter). With ``donate=True`` the graph
      reads the caller's tensors themselves: update them in place (an optimizer step) and pass
      the same tensors each call; other tensors are refused, since copying them in would
      overwrite the donated ones, which the caller may still hold.
    - The state's pools and tables are the caller's: the graph captures against them.
    - ``copy_grads=False`` hands out the graph's own gradient buffers: valid until the next
      call of this graphed step (read them, or step the optimizer, before calling again).
    - ``batch`` must hold tensors only (a value baked into a graph would silently repeat).
    - The state threads as with `run_step` (a consumed state is refused). A state from
      ``clone``, ``reset`` or a file works: its bookkeeping is copied in.
    - Needs CUDA and bf16 experts (fp32/fp16 experts take a per-group loop that reads the
      group sizes on the host, which a graph cannot capture).

    Args:
        step: a `StashAwareStep` with a ``capacity_factor``.
        max_graphs: graphs kept at most (the least recently used dropped).
        donate: the graph reads the caller's ``params`` themselves instead of copies.
        copy_grads: hand out copies of the gradients (``False``: the graph's own buffers).

    Attributes:
        captures: graphs captured so far (each warms up twice first).

    Raises:
        TypeError: ``step`` is not a `StashAwareStep`.
        ValueError: no CUDA device, or ``step``'s config has no ``capacity_factor``.
    """

    def __init__(self, step: StashAwareStep, max_graphs: int = 4, *, donate: bool = False,
                 copy_grads: bool = True, _shared: "SharedGraphs | None" = None):
        if not isinstance(step, StashAwareStep):
            raise TypeError(f"graphed needs a step made by psf.stash_aware, got "
                            f"{type(step).__name__}")
        if not torch.cuda.is_available():
            raise ValueError("graphed steps replay CUDA graphs and need a CUDA device; without "
                             "one use psf.run_step (eager)")
        if not step.cfg.uses_capacity:
            raise ValueError("graphed steps capture the capacity path: set capacity_factor")
        self.step, self.max_graphs = step, max_graphs
        self.donate, self.copy_grads = bool(donate), bool(copy_grads)
        self._captures: collections.OrderedDict = collections.OrderedDict()
        self.captures = 0      # graphs captured so far (each warms up twice first)
        self._shared = _shared

    def clear(self) -> None:
        """Drop every captured graph (and the memory its pool holds)."""
        self._captures.clear()
        torch.cuda.empty_cache()

    def __call__(self, params, batch, state: StashState, *, argnums=0,
                 group=None) -> StepResult:
        """`run_step` with the attempt replayed from this shape's graph (captured on first use).

        Args:
            params: the parameters (with ``donate=True``: the tensors the graph was captured with).
            batch: a batch of tensors only.
            state: the live `StashState`; consumed.
            argnums: as `run_step` takes it.
            group: as `run_step` takes it.

        Returns:
            A `StepResult`, as `run_step` returns it.

        Raises:
            TypeError: ``state`` is not a `StashState`.
            ValueError: a batch entry that is not a tensor, layers that run fp32/fp16 experts or
                off CUDA, a state holding stashes whose backward has not run, donated params that
                are not the captured tensors, or a stashing layer whose output does not reach the
                loss.
            ConsumedStateError: ``state`` was consumed by an earlier call.
        """
        return self.attempt(params, batch, state, argnums=argnums, group=group)

    def prepare(self, params, batch, state: StashState, *, argnums=0) -> None:
        """Capture the graph for these shapes now, if it is not yet.

        The two warm-up attempts and the capture run here, not in the first call. ``state`` stays
        live.

        Args:
            params: parameters of the shapes the calls will take.
            batch: a batch of the shapes the calls will take (tensors only).
            state: a live `StashState` for that batch; not consumed.
            argnums: as the calls will take it.

        Raises:
            ValueError: as the call raises it, for what a graph cannot capture.
            ConsumedStateError: ``state`` was consumed by an earlier call.
        """
        _check_capturable(state, batch)
        state.check_alive()
        self._lookup(params, batch, state, argnums)

    def _lookup(self, params, batch, state, argnums) -> _Capture:
        key = _key(params, batch, state, argnums)
        cap = self._captures.get(key)
        if cap is None:
            cap = self._capture(params, batch, state, argnums)
            self._captures[key] = cap
            while len(self._captures) > self.max_graphs:
                self._captures.popitem(last=False)
        self._captures.move_to_end(key)
        return cap

    def attempt(self, params, batch, state: StashState, *, argnums=0, group=None,
                rerun: bool = True, while_waiting=None,
                inputs_copied: bool = False) -> StepResult:
        """The call, with the controls an adaptive step uses.

        With ``rerun=False`` a flagged attempt is returned as it is (its gradients those of the
        step with the dropped pairs, ``report.reran`` false and its flags set), for a caller that
        reruns on its own terms, as `AdaptiveStep` does.

        Args:
            params: as the call takes them.
            batch: as the call takes it.
            state: the live `StashState`; consumed.
            argnums: as `run_step` takes it.
            group: as `run_step` takes it.
            rerun: rerun a flagged attempt on the exact path (as the call does).
            while_waiting: ``while_waiting(new_state)`` runs on the host while the replay runs,
                before the flag read waits for it (`finish_step`).
            inputs_copied: these ``params`` and ``batch`` are the ones the last attempt of a graph
                sharing this one's buffers (`SharedGraphs`) copied in, so they are not copied
                again (a rerun at another rung of the same call).

        Returns:
            A `StepResult`.
        """
        _check_capturable(state, batch)
        state.check_alive()
        cap = self._lookup(params, batch, state, argnums)
        if self.donate:
            _check_donated(params, cap.params)
        shared = self._shared
        if not (inputs_copied and shared is not None
                and shared.filled == (id(cap.params), id(cap.batch))):
            _copy_in(params, cap.params)
            _copy_in(batch, cap.batch)
            if shared is not None:
                shared.filled = (id(cap.params), id(cap.batch))
        _copy_state_in(state, cap.state)
        state.consume("a graphed step")
        cap.graph.replay()
        grads = pytree.tree_map(_clone, cap.grads) if self.copy_grads or cap.released \
            else cap.grads
        loss, aux = pytree.tree_map(_clone, (cap.loss, cap.aux))
        if shared is None:
            new_state = cap.new_state.successor()
        else:                             # the tables the graph copied its own into
            new_state = cap.new_state.successor(tables=dict(cap.state.tables))
        return finish_step(self.step, params, batch, argnums, grads, loss, aux, new_state, (),
                           state, group, rerun, while_waiting)

    def _capture(self, params, batch, state, argnums) -> _Capture:
        try:
            cap = self._capture_on(params, batch, state, argnums)
            self.captures += 1
            return cap
        except _Refused as refused:     # refused before anything ran: the state is as it was
            raise refused.err from None
        except BaseException as err:
            # the warm-ups and the capture ran on the caller's pools: pages may be held there
            state.mark_failed(f"a graphed step whose capture failed ({type(err).__name__}: "
                              f"{err}); its pools may hold pages")
            raise

    def _capture_on(self, params, batch, state, argnums) -> _Capture:
        attempt = value_and_grad(self.step.attempt, argnums=argnums, has_aux=True)
        shared = self._shared
        static_params, static_batch = self._static_inputs(params, batch)
        # the caller's buffers, under a state of the graph's own (the caller's stays live
        # until the call consumes it); warm-ups thread it on, and every page is free after
        # each complete attempt, so the captured state is the caller's pools as they were
        static_state = state.successor()
        # in a shared pool, gradients handed out as copies are read right after their own
        # graph's replay, before any other replays: their memory goes back to the pool, for
        # the next capture to reuse (no rung holds a gradient set between steps); handed out
        # as they are, they are copied into buffers every graph of the pool shares
        release = shared is not None and self.copy_grads and _POOL_VIEWS
        static_state, release, into, like = self._warm_up(
            attempt, static_params, static_batch, static_state, release)
        outs = None
        if shared is not None:
            outs = shared.buffers("outputs", like)
            # the graph never reads its static state's flags and counts (an attempt starts
            # from zeros shaped like them): it holds the ones every graph of the pool shares,
            # not the warm-ups'
            static_state = static_state.successor(flags=outs[2], counts=dict(outs[3]))
        del like
        graph, grads, loss, aux, new_state = self._record(
            attempt, static_params, static_batch, static_state, release, into, outs)
        if into is not None:
            grads = into             # the graph's own gradients are temporaries of the pool
        elif release:
            grads = pytree.tree_map(_pool_view, grads)   # the owning tensors die here
        if shared is not None:
            # the graph copied its page tables, flags, counts, loss and aux into static
            # buffers outside the pool: what it hands on holds those
            loss, aux, flags, counts = outs
            new_state = new_state.successor(tables=dict(static_state.tables), flags=flags,
                                            counts=dict(counts))
        if new_state.pending:
            raise ValueError("a graphed step needs every stashing layer's output to reach the "
                             f"loss (layers {[r.layer for r in new_state.pending]} had no "
                             f"backward); use eager psf.run_step, which reclaims their pages")
        return _Capture(graph, static_params, static_batch, static_state, grads, loss, aux,
                        new_state, release and into is None)

    def _static_inputs(self, params, batch) -> tuple:
        """The params and batch a graph reads: the pool's shared buffers (or the caller's
        params, donated), else clones; the warm-ups read the real values."""
        shared = self._shared
        if shared is None:
            return (params if self.donate else pytree.tree_map(_clone, params),
                    pytree.tree_map(_clone, batch))
        static_params = params if self.donate else shared.buffers("params", params)
        static_batch = shared.buffers("batch", batch)
        _copy_in(params, static_params)
        _copy_in(batch, static_batch)
        shared.filled = (id(static_params), id(static_batch))
        return static_params, static_batch

    def _warm_up(self, attempt, static_params, static_batch, static_state, release):
        """Two attempts on a side stream (kernels compiled, handles made):
        ``(state to capture with, release, gradient buffers or None, like)``, ``like``
        shaped like the loss, aux, flags and routing counts the graph returns. ``release``
        stays only if every gradient is strided (a sparse one has no one storage to view)."""
        shared, into = self._shared, None
        side = _warmup_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for k in range(2):
                try:
                    warm_grads, (warm_loss, rest) = attempt(static_params, static_batch,
                                                            static_state)
                except StateMismatchError as err:
                    if k == 0 and not static_state.consumed:   # refused before it stashed
                        raise _Refused(err) from None
                    raise
                release = release and all(
                    t.layout == torch.strided for t in pytree.tree_leaves(warm_grads)
                    if isinstance(t, torch.Tensor))
                if shared is not None and not release and into is None:
                    into = shared.buffers("grads", warm_grads)   # shaped like the gradients
                warm = rest[1] if isinstance(rest, tuple) else rest
                like = (warm_loss, rest[0] if isinstance(rest, tuple) else None, warm.flags,
                        warm.counts)
                del warm_grads, warm_loss     # one warm-up's outputs at a time, not two
                warm, _ = reclaim(warm)
                static_state = warm.successor()
        torch.cuda.current_stream().wait_stream(side)
        return static_state, release, into, like

    def _record(self, attempt, static_params, static_batch, static_state, release, into,
                outs):
        """The CUDA graph of one attempt: ``(graph, grads, loss, aux, new state)``. In a
        shared pool the graph copies its gradients into ``into`` (if given), its page
        tables into its static input tables, and its loss, aux, flags and counts into
        ``outs``, the buffers every graph of the pool shares."""
        shared = self._shared
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared.pool if shared is not None else None):
            grads, (loss, rest) = attempt(static_params, static_batch, static_state)
            if release:               # a view's conj or neg bit would not survive _pool_view
                grads = pytree.tree_map(
                    lambda t: t.resolve_conj().resolve_neg() if isinstance(t, torch.Tensor)
                    else t, grads)
            if into is not None:
                for buffer, g in zip(pytree.tree_leaves(into), pytree.tree_leaves(grads)):
                    buffer.copy_(g)
            aux, new_state = rest if isinstance(rest, tuple) else (None, rest)
            if shared is not None:
                # another graph's replay may write where this one's outputs live, and any
                # output a graph kept in the pool would be held once per graph: the page
                # tables go, in the graph, into its static input tables, the loss, aux, flags
                # and routing counts into the buffers every graph of the pool shares (all
                # outside the pool), and the graph's own go back to the pool
                for name, table in new_state.tables.items():
                    static_state.tables[name].copy_(table)
                pytree.tree_map(_copy_into, outs, (loss, aux, new_state.flags,
                                                   new_state.counts))
        return graph, grads, loss, aux, new_state


class _Refused(Exception):
    """A first warm-up refused by the step before it changed anything (another batch shape)."""

    def __init__(self, err):
        super().__init__(str(err))
        self.err = err


def graphed(step: StashAwareStep, max_graphs: int = 4, *, donate: bool = False,
            copy_grads: bool = True) -> GraphedStep:
    """`run_step` from a captured CUDA graph; see `GraphedStep`.

    Args:
        step: a `StashAwareStep` with a ``capacity_factor``.
        max_graphs: graphs kept at most (the least recently used dropped).
        donate: the graph reads the caller's ``params`` themselves instead of copies.
        copy_grads: hand out copies of the gradients (``False``: the graph's own buffers,
            valid until the next call).

    Returns:
        A `GraphedStep`.

    Raises:
        TypeError: ``step`` is not a `StashAwareStep`.
        ValueError: no CUDA device, or ``step``'s config has no ``capacity_factor``.

    Example::

        gstep = psf.graphed(step)
        for batch in batches:
            res = gstep(params, batch, state)
            state = res.state
    """
    return GraphedStep(step, max_graphs, donate=donate, copy_grads=copy_grads)


class SharedGraphs:
    """What the graphs of several graphed steps (an adaptive step's rungs) share: one
    graph memory pool, so that their temporaries overlap (one replays at a time), and one set
    of static buffers per kind (``"params"``, ``"batch"``, ``"grads"``, ``"outputs"``) per
    tree shape, so that no rung holds a copy of its own. Gradients handed out as copies
    (``copy_grads``, the default) are copied out right after their graph's replay, so their
    memory is left to the pool: a later capture reuses it, and no graph holds a gradient set
    between steps (the pool then peaks about where its largest graph does). Handed out as
    they are, each graph writes them into the shared buffers at the end of its replay (one
    copy of the gradients a step). Each graph copies, in the graph, its page tables into its
    state's own and its loss, aux, flags and routing counts into the shared ``"outputs"``, so
    that it keeps none of its outputs in the pool: what a further rung holds is its state's
    page tables. The outputs of one graph are valid until another graph of the pool
    replays."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self._buffers: dict = {}
        self.filled = None       # ids of the params and batch buffers last copied into

    def buffers(self, kind: str, like):
        """The shared buffers shaped like the tree ``like`` (made once, outside the pool)."""
        leaves, spec = pytree.tree_flatten(like)
        key = (kind, str(spec), tuple((tuple(t.shape), t.dtype, str(t.device))
                                      if isinstance(t, torch.Tensor) else repr(t)
                                      for t in leaves))
        if key not in self._buffers:
            self._buffers[key] = pytree.tree_map(
                lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, like)
        return self._buffers[key]


def _check_capturable(state, batch) -> None:
    if not isinstance(state, StashState):
        raise TypeError(f"a graphed step needs the StashState from step.init, got "
                        f"{type(state).__name__}")
    slow = [info.name for info in state.layers
            if info.dtype != torch.bfloat16 or state.flags.device.type != "cuda"]
    if slow:
        raise ValueError(f"layers {slow} run fp32/fp16 experts or off CUDA: their grouped GEMMs "
                         f"read the group sizes on the host, which a CUDA graph cannot capture. "
                         f"Compute the experts in bf16 on CUDA (cast inside the loss, e.g. the "
                         f"demo's --dtype bf16)")
    for path, leaf in pytree.tree_flatten_with_path(batch)[0]:
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"batch{pytree.keystr(path)} is a {type(leaf).__name__}: a graph "
                             f"would bake its value in; pass tensors only")
    if state.pending:
        raise ValueError("this state holds stashes whose backward has not run: reclaim them "
                         "(psf.reclaim) before a graphed step")


def _key(params, batch, state, argnums):
    leaves, spec = pytree.tree_flatten((params, batch))
    shapes = tuple((tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor)
                   else (type(t).__name__,) for t in leaves)
    return (str(spec), shapes, state.specs, tuple(state.layer_pools.items()), state.layers,
            argnums)


_WARMUP_STREAMS: dict = {}


def _warmup_stream() -> torch.cuda.Stream:
    """The one side stream of the current device that every capture warms up on: cuBLAS
    keeps a workspace (tens of MiB) for each stream it has run on, so a stream per capture
    would hold one more workspace per graph for the life of the process."""
    device = torch.cuda.current_device()
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


_POOL_VIEWS = hasattr(torch._C, "_construct_storage_from_data_pointer")


def _pool_view(t):
    """A tensor over ``t``'s memory that does not own it (``t`` itself may then die, and its
    graph-pool memory be reused by a later capture into that pool); read it only right after
    the replay of the graph that wrote ``t``, while the pool lives."""
    if not isinstance(t, torch.Tensor):
        return t
    storage = t.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device,
                                                             storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        borrowed, t.storage_offset(), t.shape, t.stride())


def _copy_into(buffer, value):
    """``value`` into ``buffer`` (tensors; another leaf, or ``None``, stays as it is)."""
    if isinstance(value, torch.Tensor):
        buffer.copy_(value)
    return buffer


def _clone(t):
    """A copy the next replay will not overwrite (``aux`` may be ``None``)."""
    return t.clone() if isinstance(t, torch.Tensor) else t


def _check_donated(values, static) -> None:
    """Donated params must be the tensors the graph was captured with."""
    for i, (value, target) in enumerate(zip(pytree.tree_leaves(values),
                                            pytree.tree_leaves(static))):
        if value is not target:
            raise ValueError(
                f"params leaf {i} is not the tensor this graph was captured with: a graph made "
                f"with donate=True reads the donated tensors themselves, so update them in place "
                f"(an optimizer step) and pass the same ones each call, or make the graph with "
                f"donate=False, which copies params in")


def _copy_in(values, static) -> None:
    for value, target in zip(pytree.tree_leaves(values), pytree.tree_leaves(static)):
        if value is not target:
            target.copy_(value)


def _copy_state_in(state: StashState, static: StashState) -> None:
    """The bookkeeping of ``state`` into the graph's own (pool contents do not matter between
    steps: every page is free). Nothing to copy when ``state`` came from this graph."""
    for lay in state.layouts:
        mine, theirs = state.pools[lay.key], static.pools[lay.key]
        if mine.free_pages is not theirs.free_pages:
            theirs.free_pages.copy_(mine.free_pages)
            theirs.cursors.copy_(mine.cursors)
    for name, table in state.tables.items():
        if table is not static.tables[name]:
            static.tables[name].copy_(table)
