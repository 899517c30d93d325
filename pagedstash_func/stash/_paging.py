"""Stash and pop as functions of a `StashState`: the explicit, lower-level form.

``state = stash(state, name, src, n_rows)`` and ``out, state = pop(state, name)`` run one kernel
each and return a new state sharing the old one's buffers; the old state is consumed. Reading
flags or page counts on the host (`read_flags`, `pages_in_use`) is a sync, meant for the runner
and for reports, never for the inside of a step.

`StashSlot` is the one place where a page table meets its pool: the five tensors a stash or pop
kernel takes, built by `stash_slot` and flattened for an ``autograd.Function`` by
`flatten_slots` / `unflatten_slots`. `Stasher` is how a layer stashes while it computes (a copy
on a CUDA side stream, joined before the layer returns; ``gate_up`` written into its pages by
the SwiGLU kernel that reads it).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .. import kernels
from ._state import StashState

layout = kernels.layout


class StashSlot(NamedTuple):
    """The op arguments of one stashed tensor: its page table and its pool's tensors.

    Attributes:
        table: the tensor's page table, ``[4 + ceil(capacity / page_size)]`` int32.
        cuda: the pool's device rows (`Pool` ``.cuda``).
        host: the pool's host rows (`Pool` ``.host``).
        free_pages: the pool's free stacks (`Pool` ``.free_pages``).
        cursors: the pool's cursors (`Pool` ``.cursors``).
    """

    table: torch.Tensor
    cuda: torch.Tensor
    host: torch.Tensor
    free_pages: torch.Tensor
    cursors: torch.Tensor


@dataclasses.dataclass(eq=False)
class StashRecord:
    """Host-side status of the pages one MoE call stashed, shared with its backward.

    ``status``: ``"held"`` (stashed, backward not run), ``"popped"`` (backward gave the pages
    back), ``"released"`` (given back without a backward, by `run_step`, `reclaim` or
    `reset`), ``"failed"`` (a backward raised halfway: pending again, so that `reclaim` gives
    back whatever its tables still hold). A backward that finds anything but ``"held"`` refuses
    to run: its pages are gone. ``private``: with ``pool_scope="layer"``, the `StashSlot` of
    each table in the call's own pool, until its backward takes them (it drops each once
    read, which frees the pool). ``buffers``: with ``pool_scope="layer"``, the tensors whose
    own pool would not be smaller than the buffer it replaces (`_pools.kept_whole`), by short
    name (``"act_in"``): the buffer itself, ``[C, width]`` on the device, valid rows below
    ``n``, kept from the forward to its backward instead of paged. ``compiled``: the call was
    traced into a `psf.compile` graph, whose hooks claim the record (`step._compile`); the
    graph owns its pools and buffers then, and ``private`` and ``buffers`` stay empty.
    """

    layer: str
    tables: tuple[str, ...]
    status: str = "held"
    private: dict = dataclasses.field(default_factory=dict)
    buffers: dict = dataclasses.field(default_factory=dict)
    compiled: bool = False      # traced into `psf.compile`'s graph, which claims it

    def claim(self) -> None:
        """Mark this call's pages as being popped; refuse if they are gone already."""
        if self.status == "popped":
            raise RuntimeError(
                f"a second backward through {self.layer}, whose activations were stashed in "
                f"pages: the first backward already gave those pages back. A stashed step can be "
                f"differentiated once (no retain_graph=True reuse, no second call of a vjp "
                f"function); run that step with paged_stash=False to differentiate it twice.")
        if self.status == "released":
            raise RuntimeError(
                f"the backward of {self.layer} ran after its stashed pages were reclaimed (by "
                f"run_step or psf.reclaim, because no backward had used them by then, or by "
                f"psf.reset). Run the "
                f"backward before the step ends, or reclaim only after every backward is done.")
        if self.status == "failed":
            raise RuntimeError(
                f"an earlier backward through {self.layer} failed halfway (its stashed pages may "
                f"be partly given back already), so they cannot be read again. Reclaim the state "
                f"(psf.reclaim; run_step starts from the state it was given) and run the step "
                f"again.")
        self.status = "popped"

    def let_go(self) -> None:
        """Drop what this record holds of its layer's own (pools, kept buffers): freed now,
        unless a backward still reads them."""
        self.private, self.buffers = {}, {}


def stash_slot(state: StashState, name: str) -> StashSlot:
    """The `StashSlot` of the stashed tensor ``name``.

    Args:
        state: a state holding ``name``'s pool (``pool_scope="state"``).
        name: the stashed tensor's `StashSpec` name (``"moe0/act_in"``).

    Returns:
        A `StashSlot` of the state's own tensors (no copies).

    Raises:
        KeyError: no stashed tensor has that name; the message names the known ones.
        ValueError: its pool is its layer's own (``pool_scope="layer"``), which no state holds.
    """
    spec = state.spec(name)
    if name in state.layer_pools:
        raise ValueError(
            f"{name!r} is paged in a pool of its layer's own (pool_scope='layer'), which its "
            f"MoE call allocates and its backward frees: the state holds no pool to stash into "
            f"or pop from by hand. Build the state with pool_scope='state' to use psf.stash, "
            f"psf.pop or psf.stash_slot.")
    pool = state.pools[state.layout_of(spec).key]
    return StashSlot(state.tables[name], pool.cuda, pool.host, pool.free_pages, pool.cursors)


def flatten_slots(slots) -> list[torch.Tensor]:
    """Slots as a flat tensor list: under ``torch.func`` only top-level tensor arguments of an
    ``autograd.Function`` arrive unwrapped."""
    return [t for slot in slots for t in slot]


def unflatten_slots(tensors) -> list[StashSlot]:
    """Inverse of `flatten_slots`."""
    width = len(StashSlot._fields)
    return [StashSlot(*tensors[i:i + width]) for i in range(0, len(tensors), width)]


def stash(state: StashState, name: str, src: torch.Tensor, n_rows: torch.Tensor, *,
          block: int = 0, programs: int = 0) -> StashState:
    """Copy rows ``[0, n_rows)`` of ``src`` into pages; returns the next state.

    Args:
        state: a live state; consumed.
        name: the `StashSpec` name to stash under.
        src: ``[capacity, W]``, contiguous, the spec's dtype and capacity, on the state's device.
        n_rows: one-element int tensor on the device: the valid rows (clamped to
            ``[0, capacity]``). Never read on the host.
        block: elements per tile of the copy kernel (0: chosen for the device and row width).
        programs: most programs in the kernel's grid (0: chosen for the device).

    Returns:
        The next `StashState`, sharing ``state``'s buffers.

    Raises:
        ValueError: ``src`` is not ``[capacity, W]`` of the spec's dtype, ``n_rows`` is not a
            one-element integer tensor, or the tensor's pool is its layer's own.
        KeyError: no stashed tensor has that name.
        ConsumedStateError: ``state`` was consumed already.
    """
    spec = state.spec(name)
    if tuple(src.shape) != (spec.capacity, spec.width) or src.dtype != spec.dtype:
        raise ValueError(f"{name!r} stashes [{spec.capacity}, {spec.width}] {spec.dtype}; "
                         f"got {list(src.shape)} {src.dtype}")
    if n_rows.numel() != 1 or n_rows.dtype.is_floating_point:
        raise ValueError(f"n_rows must be a one-element integer tensor, got {n_rows.shape} "
                         f"{n_rows.dtype}")
    slot = stash_slot(state, name)          # refused before the state is consumed
    state.consume(f"stash(state, {name!r}, ...)")
    kernels.stash_copy(src, n_rows, *slot, state.flags, state.page_size, state.backend, block,
                       programs, 0, spec.balanced_rows)
    return state.successor()


def pop(state: StashState, name: str, *, block: int = 0,
        programs: int = 0) -> tuple[torch.Tensor, StashState]:
    """Rebuild ``[capacity, W]`` from the pages of ``name`` (rows ``>= n`` zero), free them.

    A tensor that holds nothing (never stashed, overflowed, or popped already) pops as zeros.

    Args:
        state: a live state; consumed.
        name: the `StashSpec` name to pop.
        block: elements per tile of the copy kernel (0: chosen for the device and row width).
        programs: most programs in the kernel's grid (0: chosen for the device).

    Returns:
        ``(rows, next_state)``: ``rows`` ``[capacity, W]`` in the spec's dtype on the state's
            device, and the next `StashState`, sharing ``state``'s buffers.

    Raises:
        KeyError: no stashed tensor has that name.
        ValueError: the tensor's pool is its layer's own (``pool_scope="layer"``).
        ConsumedStateError: ``state`` was consumed already.
    """
    spec, slot = state.spec(name), stash_slot(state, name)
    state.consume(f"pop(state, {name!r})")
    out = kernels.stash_pop(*slot, spec.capacity, state.page_size, state.backend, block,
                            programs)
    return out, state.successor()


def reclaim(state: StashState) -> tuple[StashState, tuple[str, ...]]:
    """Give back the pages of every stash whose backward has not run.

    `run_step` does this after its attempt (an output used only in ``aux``, or detached, never
    runs its backward, and its pages would stay held forever). With the raw ``step`` form, call
    it once every backward of the step is done (after the last micro-batch when accumulating
    gradients): a backward that runs after its pages were reclaimed raises instead of reading
    them. No host read.

    Args:
        state: the state a step returned; consumed when anything was pending.

    Returns:
        ``(state, layers)``: the next state (``state`` itself when nothing was pending) and
            the names of the layers whose pages went back.
    """
    held = state.pending
    if not held:
        return state, ()
    state.consume("reclaim")
    released = state.release(held)
    for record in held:
        record.status = "released"
        record.let_go()            # the record's hold on a layer's own pool goes
    return released.successor(pending=()), tuple(record.layer for record in held)


def read_flags(state: StashState) -> dict[str, bool]:
    """The flags as Python bools: one device-to-host read.

    Args:
        state: any state (not consumed by the read).

    Returns:
        ``{"overflow": bool, "host_spill": bool, "over_budget": bool, "bad_id": bool}``.
    """
    values = state.flags.tolist()
    return {name: bool(values[i]) for i, name in enumerate(layout.FLAG_NAMES)}


def pages_in_use(state: StashState) -> dict[str, dict[str, int]]:
    """CUDA and host pages held now per pool, and their totals. Syncs.

    A pool is named as ``"bfloat16x2048"``; with ``pool_scope="layer"`` per stashed tensor,
    ``"moe0/act_in"``. A layer's own pool exists only while its stash waits for its backward;
    otherwise it counts as holding nothing.

    Args:
        state: any state (not consumed by the read).

    Returns:
        ``{pool name: {"cuda_used", "host_used", "cuda_pages", "host_pages"}}``, ints.
    """
    report = {}
    pools = [(lay.name, lay, state.pools[lay.key].cursors) for lay in state.layouts]
    held = {n: slot for r in state.pending for n, slot in r.private.items()}
    pools += [(n, lay, held[n].cursors if n in held else None)
              for n, lay in state.layer_pools.items()]
    for name, lay, cursors in pools:
        free = cursors.tolist() if cursors is not None else [lay.cuda_pages, lay.host_pages]
        report[name] = {
            "cuda_used": lay.cuda_pages - free[layout.CUR_CUDA_FREE],
            "host_used": lay.host_pages - free[layout.CUR_HOST_FREE],
            "cuda_pages": lay.cuda_pages, "host_pages": lay.host_pages,
        }
    return report


def table_view(state: StashState, name: str) -> dict:
    """What the page table of ``name`` says, on the host: rows held and page ids. Syncs.

    Args:
        state: any state (not consumed by the read).
        name: the stashed tensor's `StashSpec` name.

    Returns:
        ``{"rows": int, "pages": [ids], "cuda_pages": [ids], "host_pages": [ids]}``: ``rows``
            is ``-1`` while the table holds nothing; host page ids count from 0 within the host
            tier.
    """
    table = state.tables[name].tolist()
    pages = table[layout.TAB_PAGES]
    own = state.layer_pools.get(name)
    cuda_pages = (own or state.layout_of(state.spec(name))).cuda_pages
    ids = table[layout.HEADER:layout.HEADER + pages]
    return {"rows": table[layout.TAB_ROWS], "pages": ids,
            "cuda_pages": [p for p in ids if p < cuda_pages],
            "host_pages": [p - cuda_pages for p in ids if p >= cuda_pages]}


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The one side stream the layer copies pages on, per CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]


_SIDE: dict = {}


class Stasher:
    """Puts what a layer stashes (`stashed_names`) into pages while the layer computes.

    ``gate_up`` (act_in) is written into its pages by the SwiGLU kernel that reads it anyway
    (`swiglu`). A plain copy (`stash`: ``x_rows``, the fc1 input across ranks) runs on CUDA on
    the side stream (`side_stream`) after waiting for the main stream, so it may overlap the
    gate_up GEMM; `join` makes the main stream wait for it before the layer returns (and
    before `swiglu` reserves pages), so from outside the layer is as pure as before (the
    state's pools, tables and flags are ready when it returns), no host waits for anything
    (events only), a CUDA graph captures the fork and the join, and the padded buffer, still
    referenced until the layer returns, cannot be reused while the copy reads it. Page
    bookkeeping happens in stash order: the same bits as everything on the main stream.
    Elsewhere the copies run in place.
    """

    def __init__(self, static, stash_args, n_valid, tracing: bool = False):
        self.static, self.n_valid = static, n_valid
        self.flags, self.slots = stash_args[0], unflatten_slots(stash_args[1:])
        # traced by torch.compile: in place, on the compiler's stream
        self.side = None if tracing else side_stream(n_valid.device)
        self.forked = False     # whether the side stream holds work of this layer

    def stash(self, src: torch.Tensor, index: int) -> None:
        if self.side is None:                   # in place, on any device
            return self._copy(src, index)
        self.side.wait_stream(torch.cuda.current_stream(src.device))
        self.forked = True
        with torch.cuda.stream(self.side):
            self._copy(src, index)

    def _copy(self, src, index):
        static = self.static
        kernels.stash_copy(src, self.n_valid, *self.slots[index], self.flags, static.page_size,
                           static.backend, 0, 0, 0, static.expected_rows)

    def swiglu(self, gate_up: torch.Tensor, w_rows: torch.Tensor, index: int) -> torch.Tensor:
        """``z = silu(gate) * up * w`` with ``gate_up``'s valid rows written into its pages by
        the same kernel (`kernels.swiglu_forward_stash`, after `kernels.stash_reserve` takes the
        pages), on the main stream: one read of ``gate_up`` serves both. Any copy still running
        on the side stream is joined first: it shares the flags (and maybe the pool) with this
        reservation, whose order must not depend on timing."""
        static, slot = self.static, self.slots[index]
        self.join()
        kernels.stash_reserve(self.n_valid, slot.table, slot.cuda, slot.host, slot.free_pages,
                              slot.cursors, self.flags, static.rows, static.page_size,
                              static.backend)
        return kernels.swiglu_forward_stash(gate_up, w_rows, self.n_valid, slot.table,
                                            slot.cuda, slot.host, static.page_size,
                                            static.backend)

    def join(self) -> None:
        # Only after a fork: waiting on a side stream that holds no work of this layer would,
        # under CUDA-graph capture, tie the graph to work outside it (and is a no-op anyway).
        if self.forked:
            torch.cuda.current_stream(self.n_valid.device).wait_stream(self.side)
            self.forked = False
