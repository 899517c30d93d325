"""`StashState`: pools, free lists, page tables and flags, as an explicit pytree.

A state is a value that goes into a step and comes out of it. The tensors in it are the leaves
(mutated only by the kernels in `pagedstash_func.kernels`); everything static (pool layouts,
which tensors are stashed, the id that marks a state consumed) lives in the pytree *context*,
so it survives `torch.func` transforms, which wrap every leaf.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from . import kernels
from ._config import StashConfig

layout = kernels.layout


@dataclasses.dataclass(frozen=True)
class StashSpec:
    """One tensor a step stashes: rows of ``width`` elements of ``dtype``.

    Attributes:
        name: unique key of its page table (e.g. ``"moe0/fc1_in"``).
        capacity: rows of the capacity-padded buffer it comes from.
        balanced_rows: rows it would hold under perfectly even routing (DESIGN §2's ``B``).
        observed_rows: rows seen in a profiling pass; needed only for negative factors.
    """

    name: str
    width: int
    dtype: torch.dtype
    capacity: int
    balanced_rows: int
    observed_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static shape of the pool of one (dtype, width)."""

    dtype: torch.dtype
    width: int
    page_size: int
    cuda_pages: int
    host_pages: int

    @property
    def key(self) -> tuple[torch.dtype, int]:
        return (self.dtype, self.width)

    @property
    def name(self) -> str:
        """``"bfloat16x2048"``: how reports and `pages_in_use` name this pool."""
        return f"{str(self.dtype).removeprefix('torch.')}x{self.width}"

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.width * torch.empty((), dtype=self.dtype).element_size()


class Pool(NamedTuple):
    """The tensors of one pool (see `pagedstash_func.kernels.layout`)."""

    cuda: torch.Tensor        # [cuda_pages * page_size, W] on the device
    host: torch.Tensor        # [host_pages * page_size, W] pinned host memory (or [1, W] on
                              # the device when there is no host tier)
    free_pages: torch.Tensor  # [cuda_pages + host_pages] int32, two free stacks
    cursors: torch.Tensor     # [4] int32: free CUDA pages, free host pages, ticket, spare


class _Token:
    """Identity of one state value; ``consumed_by`` says which call used it up."""

    __slots__ = ("consumed_by",)

    def __init__(self):
        self.consumed_by: str | None = None


@dataclasses.dataclass(frozen=True)
class _Meta:
    layouts: tuple[PoolLayout, ...]
    specs: tuple[StashSpec, ...]
    count_names: tuple[str, ...]
    page_size: int
    backend: str
    token: _Token
    layers: tuple = ()    # static description of the MoE calls of a step (set by stash_aware)


class ConsumedStateError(ValueError):
    """A `StashState` was used after the call it was passed to had consumed it."""


_CONSUMED = """This StashState was already consumed by {by}.
Did you pass the state returned by the previous step?
A state is like a donated buffer: each call takes one and returns the next, and the pages of the
old one now belong to the new one. Rebind the name to the state the call returned:

    loss, state = step(params, batch, state)      # not: loss, _ = step(params, batch, state)

To run twice from one state on purpose, copy it first: `spare = state.clone()`."""


class StashState:
    """Pools, free lists, page tables and flags of a stash-aware step (a registered pytree).

    Leaves (all on the device but the host pools): per pool ``cuda``, ``host``, ``free_pages``,
    ``cursors``; per stashed tensor a page table ``[4 + ceil(capacity / page_size)]`` int32;
    ``flags [4]`` int32 (``overflow``, ``host_spill``, ``over_budget``, ``bad_id``); and named
    routing ``counts``. Build one with `init_stash_state`; never read its tensors inside a step.
    """

    __slots__ = ("pools", "tables", "flags", "counts", "_meta")

    def __init__(self, pools: dict, tables: dict, flags: torch.Tensor, counts: dict,
                 meta: _Meta):
        self.pools = pools
        self.tables = tables
        self.flags = flags
        self.counts = counts
        self._meta = meta

    # -- views of the static part
    @property
    def layouts(self) -> tuple[PoolLayout, ...]:
        return self._meta.layouts

    @property
    def specs(self) -> tuple[StashSpec, ...]:
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

    def spec(self, name: str) -> StashSpec:
        for s in self._meta.specs:
            if s.name == name:
                return s
        known = ", ".join(s.name for s in self._meta.specs) or "none"
        raise KeyError(f"no stashed tensor named {name!r} in this state (known: {known})")

    def layout_of(self, spec: StashSpec) -> PoolLayout:
        for lay in self._meta.layouts:
            if lay.key == (spec.dtype, spec.width):
                return lay
        raise KeyError(f"no pool for {spec.dtype} rows of width {spec.width}")

    # -- consumption
    @property
    def consumed(self) -> bool:
        return self._meta.token.consumed_by is not None

    def check_alive(self) -> None:
        """Raise `ConsumedStateError` if an earlier call consumed this state."""
        by = self._meta.token.consumed_by
        if by is not None:
            raise ConsumedStateError(_CONSUMED.format(by=by))

    def consume(self, by: str) -> None:
        """Mark this state used up by the call named ``by`` (after `check_alive`)."""
        self.check_alive()
        self._meta.token.consumed_by = by

    def successor(self, **changes) -> "StashState":
        """A new live state sharing this one's buffers, with some fields replaced."""
        fields = dict(pools=self.pools, tables=self.tables, flags=self.flags, counts=self.counts)
        fields.update(changes)
        meta = dataclasses.replace(self._meta, token=_Token())
        return StashState(meta=meta, **fields)

    def clone(self) -> "StashState":
        """A deep copy with its own buffers and its own identity (to run twice from one state)."""
        self.check_alive()
        leaves, spec = pytree.tree_flatten(self)
        copy = pytree.tree_unflatten([_clone_leaf(t) for t in leaves], spec)
        return copy.successor()

    def __repr__(self) -> str:
        pools = ", ".join(f"{lay.dtype}x{lay.width}: {lay.cuda_pages}+{lay.host_pages} pages"
                          for lay in self.layouts)
        status = "consumed" if self.consumed else "live"
        return (f"StashState({status}; page_size={self.page_size}; pools [{pools}]; "
                f"{len(self.specs)} stashed tensors)")


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


# ----------------------------------------------------------------------------- sizing


def pool_pages(rows_per_spec: list[int], factor: float, page_size: int) -> int:
    """Pages of a pool: ``ceil(|factor| * sum(rows) / page_size)`` plus one page per tensor.

    ``rows_per_spec`` are balanced rows (``factor >= 0``) or observed rows (negative factor).
    The slack page per tensor covers each tensor's partly filled last page.
    """
    return math.ceil(abs(factor) * sum(rows_per_spec) / page_size) + len(rows_per_spec)


def _rows_for(specs: list[StashSpec], factor: float, which: str) -> list[int]:
    if factor >= 0:
        return [s.balanced_rows for s in specs]
    missing = [s.name for s in specs if s.observed_rows is None]
    if missing:
        raise ValueError(
            f"{which}={factor} is negative, which sizes the pool from rows observed in a "
            f"profiling pass, but no rows were observed for {missing}. Run a profiling pass "
            f"first (step.init does), or use a factor >= 0.")
    return [s.observed_rows for s in specs]


def init_stash_state(specs, cfg: StashConfig, device=None, *, counts=None,
                     layers=()) -> StashState:
    """Build the first `StashState` for the stashed tensors ``specs`` under ``cfg``.

    Pools, one per (dtype, width): CUDA rows ``cuda_factor * sum(balanced_rows)`` rounded up to
    pages, plus one page of slack per stashed tensor; the host pool likewise with
    ``host_factor`` (``0``: none). Negative factors multiply ``observed_rows`` instead.

    Args:
        specs: iterable of `StashSpec` with unique names.
        cfg: the `StashConfig`.
        device: where pools, tables and flags live (host pools are pinned when it is CUDA).
        counts: optional ``{name: length}`` of int64 routing counters to carry in the state.
    """
    specs = tuple(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"stashed tensor names must be unique, got {names}")
    for s in specs:
        if s.width < 1 or s.capacity < 0 or s.balanced_rows < 0:
            raise ValueError(f"bad StashSpec {s}: width >= 1, capacity >= 0 and "
                             f"balanced_rows >= 0 are needed")
    device = torch.device(device) if device is not None else torch.device("cpu")
    page = cfg.page_size
    by_key: dict[tuple, list[StashSpec]] = {}
    for s in specs:
        by_key.setdefault((s.dtype, s.width), []).append(s)
    layouts, pools = [], {}
    for (dtype, width), group in by_key.items():
        cuda_pages = pool_pages(_rows_for(group, cfg.cuda_factor, "cuda_factor"),
                                cfg.cuda_factor, page)
        host_pages = 0 if cfg.host_factor == 0 else pool_pages(
            _rows_for(group, cfg.host_factor, "host_factor"), cfg.host_factor, page)
        lay = PoolLayout(dtype, width, page, cuda_pages, host_pages)
        layouts.append(lay)
        pools[lay.key] = _new_pool(lay, device)
    counts = dict(counts or {})
    meta = _Meta(tuple(layouts), specs, tuple(counts), page, cfg.backend, _Token(),
                 tuple(layers))
    state = StashState(pools, {}, torch.zeros(layout.NUM_FLAGS, dtype=torch.int32,
                                              device=device),
                       {c: torch.zeros(n, dtype=torch.int64, device=device)
                        for c, n in counts.items()}, meta)
    return state.successor(tables=_new_tables(specs, page, device))


def _new_pool(lay: PoolLayout, device: torch.device) -> Pool:
    cuda = torch.empty(lay.cuda_pages * lay.page_size, lay.width, dtype=lay.dtype, device=device)
    if lay.host_pages == 0:
        # No host tier: a one-row placeholder on the device, so every launch has a valid
        # pointer and nothing pinned is allocated.
        host = torch.empty(1, lay.width, dtype=lay.dtype, device=device)
    else:
        host = torch.empty(lay.host_pages * lay.page_size, lay.width, dtype=lay.dtype,
                           pin_memory=device.type == "cuda")
        host = host if device.type == "cuda" else host.to(device)
    free_pages, cursors = _fresh_free_lists(lay, device)
    return Pool(cuda, host, free_pages, cursors)


def _fresh_free_lists(lay: PoolLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Stacks are popped from the top, so storing ids descending hands out page 0 first.
    cuda_ids = torch.arange(lay.cuda_pages - 1, -1, -1, dtype=torch.int32)
    host_ids = torch.arange(lay.cuda_pages + lay.host_pages - 1, lay.cuda_pages - 1, -1,
                            dtype=torch.int32)
    free_pages = torch.cat([cuda_ids, host_ids]).to(device)
    cursors = torch.tensor([lay.cuda_pages, lay.host_pages, 0, 0], dtype=torch.int32,
                           device=device)
    return free_pages, cursors


def _new_tables(specs, page_size, device) -> dict[str, torch.Tensor]:
    tables = {}
    for s in specs:
        t = torch.zeros(layout.table_size(s.capacity, page_size), dtype=torch.int32,
                        device=device)
        t[layout.TAB_ROWS] = layout.NOTHING_HELD
        tables[s.name] = t
    return tables


def reset(state: StashState) -> StashState:
    """The initial page order, empty tables, cleared flags and counts; pools are reused.

    Consumes ``state``; returns a new state that shares its pool buffers.
    """
    state.consume("reset")
    device = state.flags.device
    pools = {}
    for lay in state.layouts:
        old = state.pools[lay.key]
        pools[lay.key] = Pool(old.cuda, old.host, *_fresh_free_lists(lay, device))
    return state.successor(
        pools=pools, tables=_new_tables(state.specs, state.page_size, device),
        flags=torch.zeros_like(state.flags),
        counts={c: torch.zeros_like(v) for c, v in state.counts.items()})
