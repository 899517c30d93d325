"""`StashState`: the explicit state of a stash-aware step, as a pytree, and its consumption rule.

A state is a value that goes into a step and comes out of it. The tensors in it are the leaves
(mutated only by the kernels in `pagedstash_func.kernels`); everything static (pool layouts,
which tensors are stashed, the id that marks a state consumed) lives in the pytree *context*,
so it survives `torch.func` transforms, which wrap every leaf. Pools, their sizing and their
initial contents are in `_pools`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from .. import kernels


class Pool(NamedTuple):
    """The tensors of one pool (see `pagedstash_func.kernels.layout`).

    ``W`` is the pool's row width; its page ids count the CUDA pages first, then the host pages.

    Attributes:
        cuda: ``[cuda_pages * page_size, W]`` on the device.
        host: ``[host_pages * page_size, W]`` pinned host memory (or ``[1, W]`` on the device
            when there is no host tier).
        free_pages: ``[cuda_pages + host_pages]`` int32, two free stacks, on the device.
        cursors: ``[4]`` int32 on the device: free CUDA pages, free host pages, 2 spare (0).
    """

    cuda: torch.Tensor        # [cuda_pages * page_size, W] on the device
    host: torch.Tensor        # [host_pages * page_size, W] pinned host memory (or [1, W] on
                              # the device when there is no host tier)
    free_pages: torch.Tensor  # [cuda_pages + host_pages] int32, two free stacks
    cursors: torch.Tensor     # [4] int32: free CUDA pages, free host pages, 2 spare (0)


class _Token:
    """Identity of one state value; ``consumed_by`` says which call used it up."""

    __slots__ = ("consumed_by", "failed")

    def __init__(self):
        self.consumed_by: str | None = None
        self.failed = False      # consumed by a call that failed after changing the buffers


@dataclasses.dataclass(frozen=True)
class _Meta:
    layouts: tuple          # PoolLayout per pool, in leaf order
    specs: tuple            # StashSpec per page table, in leaf order
    count_names: tuple[str, ...]
    page_size: int
    backend: str
    token: _Token
    layers: tuple = ()      # LayerInfo per MoE call of the step (set by stash_aware)
    pending: tuple = ()     # StashRecord of each stash whose backward has not run yet
    layer_pools: tuple = ()  # (spec name, PoolLayout) of tensors paged in a pool of their own
    groups: tuple = ()      # (layer, process group) of the step's expert-parallel layers


class ConsumedStateError(ValueError):
    """A `StashState` was used after the call it was passed to had consumed it.

    A `ValueError`; its message says which call consumed the state and how to get a usable one
    (rebind the name to the state the call returned, ``state.clone()`` before running twice
    from one state, ``psf.reset(state)`` after a call that failed halfway).
    """


class StateMismatchError(ValueError):
    """A step ran with a `StashState` built for other shapes or another config.

    The token count of another batch shape, another capacity factor: build a state for these.
    A `ValueError`.

    Args:
        message: what differs, and how to build a state that fits.
        shape: whether the batch's token count is what differs.

    Attributes:
        shape: whether the batch's token count is what differs.
    """

    def __init__(self, message: str, *, shape: bool = False):
        super().__init__(message)
        self.shape = shape


_CONSUMED = """This StashState was already consumed by {by}.
Did you pass the state returned by the previous step?
A state is like a donated buffer: each call takes one and returns the next, and the pages of the
old one now belong to the new one. Rebind the name to the state the call returned:

    loss, state = step(params, batch, state)      # not: loss, _ = step(params, batch, state)
    loss, (aux, state) = step(params, batch, state)   # when the loss returns (loss, aux)
    res = psf.run_step(step, params, batch, state); state = res.state

To run twice from one state on purpose, copy it first: `spare = state.clone()`."""


_FAILED = """This StashState was consumed by {by}.
Get a usable state back with `state = psf.reset(state)` (fresh pools, nothing held) or build a
new one with `step.init(params, batch)`."""


class StashState:
    """Pools, free lists, page tables and flags of a stash-aware step (a registered pytree).

    Leaves (all on the device but the host pools): ``flags [4]`` int32 (``overflow``,
    ``host_spill``, ``over_budget``, ``bad_id``); per pool ``cuda``, ``host``, ``free_pages``,
    ``cursors``; per stashed tensor a page table ``[4 + ceil(capacity / page_size)]`` int32;
    and named int64 routing ``counts``. Build one with `init_stash_state` (or ``step.init``);
    never read its tensors inside a step.

    A state is consumed by the call it is passed to, which returns the next one; the static part
    (layouts, specs, the MoE calls it was built for, its identity) lives in the pytree context,
    so it survives ``torch.func`` transforms.

    Args:
        pools: ``{(dtype, width): Pool}``, one `Pool` per `PoolLayout`.
        tables: ``{spec name: page table}``, each ``[4 + ceil(capacity / page_size)]`` int32.
        flags: ``[4]`` int32 on the device.
        counts: ``{name: [n] int64}`` routing counters.
        meta: the static part; made by `init_stash_state` (through ``StashState.create``),
            never by hand.

    Attributes:
        pools: ``{(dtype, width): Pool}``.
        tables: ``{spec name: page table}``.
        flags: ``[4]`` int32: ``overflow``, ``host_spill``, ``over_budget``, ``bad_id``.
        counts: ``{name: [n] int64}``, e.g. ``"moe0/expert_load"`` ``[E]`` and ``"moe0/rows"``
            ``[1]``.
    """

    __slots__ = ("pools", "tables", "flags", "counts", "_meta")

    def __init__(self, pools: dict, tables: dict, flags: torch.Tensor, counts: dict,
                 meta: _Meta):
        self.pools = pools
        self.tables = tables
        self.flags = flags
        self.counts = counts
        self._meta = meta

    @classmethod
    def create(cls, *, pools: dict, tables: dict, flags: torch.Tensor, counts: dict,
               layouts: tuple, specs: tuple, page_size: int, backend: str,
               layers: tuple = (), layer_pools: tuple = ()) -> "StashState":
        """A new live state; ``pools`` keyed by ``layout.key``, ``tables`` by ``spec.name``;
        ``layer_pools``: ``(spec name, PoolLayout)`` of the tensors whose pool is their
        layer's own (``pool_scope="layer"``), which the state sizes but does not hold."""
        meta = _Meta(tuple(layouts), tuple(specs), tuple(counts), page_size, backend, _Token(),
                     tuple(layers), layer_pools=tuple(layer_pools))
        return cls(pools, tables, flags, counts, meta)

    # -- views of the static part
    @property
    def layouts(self) -> tuple:
        """`PoolLayout` of each pool."""
        return self._meta.layouts

    @property
    def specs(self) -> tuple:
        """`StashSpec` of each stashed tensor."""
        return self._meta.specs

    @property
    def page_size(self) -> int:
        return self._meta.page_size

    @property
    def backend(self) -> str:
        return self._meta.backend

    @property
    def layers(self) -> tuple:
        """The MoE calls this state was built for (`stash_aware` fills it in)."""
        return self._meta.layers

    @property
    def pending(self) -> tuple:
        """`StashRecord` of each stash made into this state whose backward has not run yet
        (host-side bookkeeping: `run_step` and `psf.reclaim` give their pages back), or whose
        backward failed halfway (what its tables still hold goes back the same way)."""
        return tuple(r for r in self._meta.pending if r.status in ("held", "failed"))

    def spec(self, name: str):
        """The `StashSpec` named ``name``.

        Args:
            name: a stashed tensor's name (``"moe0/act_in"``).

        Returns:
            Its `StashSpec`.

        Raises:
            KeyError: no stashed tensor has that name; the message lists the known names.
        """
        for s in self._meta.specs:
            if s.name == name:
                return s
        known = ", ".join(s.name for s in self._meta.specs) or "none"
        raise KeyError(f"no stashed tensor named {name!r} in this state (known: {known})")

    @property
    def layer_pools(self) -> dict:
        """``{spec name: PoolLayout}`` of the tensors paged in a pool of their layer's own
        (``pool_scope="layer"``): allocated by the layer's forward, freed by its backward, so
        not in the state; empty with ``pool_scope="state"``."""
        return dict(self._meta.layer_pools)

    @property
    def groups(self) -> dict:
        """``{layer name: process group}`` of the layers whose experts the step that returned
        this state spread over ranks (empty: the step communicated with no one)."""
        return dict(self._meta.groups)

    def with_groups(self, groups: dict) -> "StashState":
        """This state (same buffers, same identity) with the layers' process groups recorded
        (`stash_aware` does this after a step; the runner reads flags over them)."""
        meta = dataclasses.replace(self._meta, groups=tuple(groups.items()))
        return StashState(self.pools, self.tables, self.flags, self.counts, meta)

    def layout_of(self, spec):
        """The `PoolLayout` that holds the rows of ``spec``."""
        for lay in self._meta.layouts:
            if lay.key == (spec.dtype, spec.width):
                return lay
        raise KeyError(f"no pool for {spec.dtype} rows of width {spec.width}")

    # -- consumption
    @property
    def consumed(self) -> bool:
        return self._meta.token.consumed_by is not None

    @property
    def consumed_by(self) -> str | None:
        """Which call consumed this state (``None`` while it is live)."""
        return self._meta.token.consumed_by

    def check_alive(self) -> None:
        """Raise `ConsumedStateError` if an earlier call consumed this state.

        Raises:
            ConsumedStateError: an earlier call consumed this state; the message names the call
                (and, for a call that failed halfway, says to use ``psf.reset`` or ``step.init``).
        """
        by = self._meta.token.consumed_by
        if by is not None and self._meta.token.failed:
            raise ConsumedStateError(_FAILED.format(by=by))
        if by is not None:
            raise ConsumedStateError(_CONSUMED.format(by=by))

    def consume(self, by: str) -> None:
        """Mark this state used up by the call named ``by`` (after `check_alive`)."""
        self.check_alive()
        self._meta.token.consumed_by = by

    def revive(self) -> None:
        """Undo a consumption by a call that was refused before it changed anything."""
        self._meta.token.consumed_by = None

    def mark_failed(self, what: str) -> None:
        """Mark this state consumed by a call that failed after it changed the buffers."""
        self._meta.token.consumed_by = what
        self._meta.token.failed = True

    @property
    def failed(self) -> bool:
        """Consumed by a call that failed after changing the buffers (use `psf.reset`)."""
        return self._meta.token.failed

    def settle(self) -> None:
        """Forget the records of stashes whose pages are back (popped or released): what
        `pending` shows is unchanged, and so is the state's identity. A compiled step settles
        its state before tracing, so that records no longer pending do not change what the
        compiler sees from one step to the next."""
        if len(self._meta.pending) != len(self.pending):
            self._meta = dataclasses.replace(self._meta, pending=self.pending)

    def successor(self, *, pending: tuple | None = None, **changes) -> "StashState":
        """A new live state sharing this one's buffers, with some fields replaced.

        ``pending`` replaces the records of stashes still waiting for their backward.
        """
        fields = dict(pools=self.pools, tables=self.tables, flags=self.flags, counts=self.counts)
        fields.update(changes)
        meta = dataclasses.replace(self._meta, token=_Token(),
                                   pending=self.pending if pending is None else tuple(pending))
        return StashState(meta=meta, **fields)

    def clone(self) -> "StashState":
        """A deep copy with its own buffers and its own identity (to run twice from one state).

        Pages held for a backward that has not run stay the original's: that backward pops
        the original's pools. The copy gives its copies of them back at once (with
        ``pool_scope="layer"`` its tables of them start empty), so it starts with nothing
        pending.

        Returns:
            A live `StashState`, its tensors copies on the same devices (host pools pinned as the
                original's); this state stays live.

        Raises:
            ConsumedStateError: this state was consumed already.
        """
        self.check_alive()
        leaves, spec = pytree.tree_flatten(self)
        copy = pytree.tree_unflatten([_clone_leaf(t) for t in leaves], spec)
        # A layer's own pool stays the original's: the copy's tables of it just hold nothing.
        return copy.release(self.pending).successor(pending=())

    def release(self, records) -> "StashState":
        """Give back the pages that ``records`` hold: the successor state (this one's
        buffers). Pages of this state's pools go back by a kernel, latest first, so the free
        stacks return to their order before those stashes. A table paged in its layer's own
        pool (``pool_scope="layer"``) is replaced by an empty one instead, and the pool is
        left alone: it is about to be dropped, so no kernel may still be writing it when its
        memory is reused. No host read."""
        layer_pools = self.layer_pools
        own = {name for record in records for name in record.tables if name in layer_pools}
        for record in reversed(records):
            for name in reversed(record.tables):
                if name not in own:
                    pool = self.pools[self.layout_of(self.spec(name)).key]
                    kernels.stash_release(self.tables[name], *pool, self.page_size,
                                          self.backend)
        tables = {n: empty_table(t.numel(), t.device) if n in own else t
                  for n, t in self.tables.items()}
        return self.successor(tables=tables)

    def cleared(self) -> "StashState":
        """The successor with flags and routing counts zeroed (the statistics of one step)."""
        return self.successor(flags=torch.zeros_like(self.flags),
                              counts={k: torch.zeros_like(v) for k, v in self.counts.items()})

    def __repr__(self) -> str:
        pools = ", ".join([f"{lay.name}: {lay.cuda_pages}+{lay.host_pages} pages"
                           for lay in self.layouts] +
                          [f"{name}: {lay.cuda_pages} pages of its layer's own"
                           for name, lay in self._meta.layer_pools])
        status = "consumed" if self.consumed else "live"
        return (f"StashState({status}; page_size={self.page_size}; pools [{pools}]; "
                f"{len(self.specs)} stashed tensors)")


def empty_table(size: int, device) -> torch.Tensor:
    """A new page table of ``size`` int32 entries that holds nothing, made by kernels on
    ``device`` (no host copy: `release` makes them after a step, and a graph may be near)."""
    table = torch.zeros(size, dtype=torch.int32, device=device)
    table.narrow(0, kernels.layout.TAB_ROWS, 1).fill_(kernels.layout.NOTHING_HELD)
    return table


def _clone_leaf(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t, pin_memory=t.is_pinned()) if t.device.type == "cpu" \
        else torch.empty_like(t)
    return out.copy_(t)


def _flatten(state: StashState):
    leaves = [state.flags]
    for lay in state.layouts:
        leaves.extend(state.pools[lay.key])
    leaves.extend(state.tables[s.name] for s in state.specs)
    leaves.extend(state.counts[c] for c in state._meta.count_names)
    return leaves, state._meta


def _unflatten(leaves, meta: _Meta) -> StashState:
    leaves = list(leaves)
    flags = leaves.pop(0)
    pools = {}
    for lay in meta.layouts:
        pools[lay.key] = Pool(*leaves[:4])
        del leaves[:4]
    tables = {s.name: leaves.pop(0) for s in meta.specs}
    counts = {c: leaves.pop(0) for c in meta.count_names}
    return StashState(pools, tables, flags, counts, meta)


pytree.register_pytree_node(StashState, _flatten, _unflatten,
                            serialized_type_name="pagedstash_func.StashState")
