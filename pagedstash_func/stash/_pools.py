"""Pools: what is stashed (`StashSpec`; for MoE layers `moe_stash_specs`), how big each pool
is, the first state, `reset`.

One pool per (dtype, row width) that a step stashes. CUDA pool rows are ``cuda_factor`` times
the balanced rows of the tensors it serves, rounded up to pages, plus one page of slack per
tensor; the host pool likewise with ``host_factor`` (``0``: none). A negative factor multiplies,
by its absolute value, the rows observed in a profiling pass instead.

With ``pool_scope="layer"`` each stashed tensor gets a device pool of its own instead, sized
by the same rule from its own rows: the state records its layout (``state.layer_pools``) and
its page table, and `layer_pool` allocates the pool when the layer's forward runs; the layer's
backward drops it as soon as it has read its pages, so it lives no longer than an activation
the layer would have saved. A pool that would not be smaller than the buffer it replaces is
not made at all: the layer keeps the buffer (`kept_whole`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from .. import kernels
from ..core._config import StashConfig
from ..core._routing import capacity_rows
from ._state import Pool, StashState, empty_table

layout = kernels.layout


@dataclasses.dataclass(frozen=True)
class StashSpec:
    """One tensor a step stashes: rows of ``width`` elements of ``dtype``.

    Attributes:
        name: unique key of its page table (e.g. ``"moe0/fc1_in"``).
        width: elements per row, ``W``.
        dtype: the rows' dtype (the pool's).
        capacity: rows of the capacity-padded buffer it comes from.
        balanced_rows: rows it would hold under perfectly even routing (the balanced reference).
        observed_rows: rows seen in a profiling pass; needed only for negative factors.
        layer: the MoE call it belongs to (``"moe0"``), if any; reports group by it.
    """

    name: str
    width: int
    dtype: torch.dtype
    capacity: int
    balanced_rows: int
    observed_rows: int | None = None
    layer: str | None = None


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static shape of the pool of one (dtype, width).

    Its ``key`` is ``(dtype, width)``; its ``name`` (``"bfloat16x2048"``) is how reports and
    `pages_in_use` name it.

    Attributes:
        dtype: the rows' dtype.
        width: elements per row, ``W``.
        page_size: rows per page.
        cuda_pages: pages of the device tier.
        host_pages: pages of the pinned host tier (0: none).
    """

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
        return self.page_size * self.width * self.dtype.itemsize


MAX_POOL_PAGES = 2**31 - 1     # page ids, free lists and cursors are int32


def pool_pages(rows_per_spec: list[int], factor: float, page_size: int) -> int:
    """Pages of a pool: ``ceil(|factor| * sum(rows) / page_size)`` plus one page per tensor.

    The slack page per tensor covers each tensor's partly filled last page.

    Args:
        rows_per_spec: the rows of each tensor the pool serves: balanced rows (``factor >= 0``)
            or observed rows (negative factor).
        factor: the pool's ``cuda_factor`` or ``host_factor``.
        page_size: rows per page.

    Returns:
        The number of pages.
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

    Args:
        specs: iterable of `StashSpec` with unique names.
        cfg: the `StashConfig` (page size, buffer factors, backend).
        device: where pools, tables and flags live (default the CPU; host pools are pinned
            when it is CUDA).
        counts: optional ``{name: length}`` of int64 routing counters to carry in the state.
        layers: the `LayerInfo` of each MoE call (`stash_aware` passes them).

    Returns:
        A live `StashState`: every page free, every table empty, flags and counters zero.

    Raises:
        ValueError: names that are not unique, a spec with ``width < 1`` or negative rows,
            ``cfg.layer_factors`` naming a layer no spec belongs to, a negative factor without
            observed rows, or pools larger than page ids (or, with ``pool_scope="layer"``, the
            device) can hold.
        MemoryError: the allocator cannot give a pool; the message names the pool, its size and
            the factor that sized it.
    """
    specs = tuple(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"stashed tensor names must be unique, got {names}")
    for s in specs:
        if s.width < 1 or s.capacity < 0 or s.balanced_rows < 0:
            raise ValueError(f"bad StashSpec {s}: width >= 1, capacity >= 0 and "
                             f"balanced_rows >= 0 are needed")
    stashing = {s.layer for s in specs}
    unknown = sorted(set(dict(cfg.layer_factors)) - stashing) if specs else []
    if unknown:
        raise ValueError(f"layer_factors names {unknown}, but the stashed tensors are those of "
                         f"the layers {sorted(stashing)}: name the layers as moe_stash_specs "
                         f"and moe_capacity(..., layer=...) do")
    device = torch.device(device) if device is not None else torch.device("cpu")
    own = cfg.pool_scope == "layer"
    layouts = () if own else pool_layouts(specs, cfg)
    layer_pools = tuple((s.name, pool_layouts([s], cfg)[0]) for s in specs) if own else ()
    _check_layer_pools_fit(layer_pools, specs, cfg, device)
    return StashState.create(
        pools={lay.key: _new_pool(lay, device) for lay in layouts},
        tables=_new_tables(specs, cfg.page_size, device),
        flags=torch.zeros(layout.NUM_FLAGS, dtype=torch.int32, device=device),
        counts={c: torch.zeros(n, dtype=torch.int64, device=device)
                for c, n in (counts or {}).items()},
        layouts=layouts, specs=specs, page_size=cfg.page_size, backend=cfg.backend,
        layers=layers, layer_pools=layer_pools)


def _check_layer_pools_fit(layer_pools, specs, cfg: StashConfig,
                           device: torch.device) -> None:
    """Layer pools are allocated inside the step, all of them alive between the last forward
    and the first backward: refuse, at init, sizes beyond the device's total memory (which
    no step could hold) rather than as an allocator error halfway through a step. A pool
    that would hold its whole buffer is never made (`kept_whole`): the buffer counts instead.
    Memory that is merely in use elsewhere still shows in the step."""
    if device.type != "cuda" or not layer_pools:
        return
    rows = {s.name: s.capacity for s in specs}
    need = sum(min(lay.cuda_pages * lay.page_size, rows[name]) * lay.page_bytes
               // lay.page_size for name, lay in layer_pools)
    total = torch.cuda.get_device_properties(device).total_memory
    if need > total:
        raise ValueError(
            f"cuda_factor={cfg.cuda_factor} asks for {need / 2**30:.1f} GiB of layer pools "
            f"(pool_scope='layer', all alive between forward and backward), more than the "
            f"device's {total / 2**30:.1f} GiB: use a cuda_factor near 1 (a pool holds factor "
            f"x the balanced rows)")


def layer_pool(state: StashState, name: str) -> Pool:
    """A fresh device pool of its own for the stashed tensor ``name`` (``pool_scope="layer"``),
    sized by ``state.layer_pools[name]``: allocated from the caching allocator on the state's
    device (rows uninitialised, free list full); freed when the last reference goes, which
    the layer's backward drops once the pages are back."""
    return _new_pool(state.layer_pools[name], state.flags.device)


def pool_layouts(specs, cfg: StashConfig) -> tuple[PoolLayout, ...]:
    """One `PoolLayout` per (dtype, width) of ``specs``, in order of first appearance."""
    by_key: dict[tuple, list[StashSpec]] = {}
    for s in specs:
        by_key.setdefault((s.dtype, s.width), []).append(s)
    page = cfg.page_size
    layouts = []
    for (dtype, width), group in by_key.items():
        cuda_pages = pool_pages(_rows_for(group, cfg.cuda_factor, "cuda_factor"),
                                cfg.cuda_factor, page)
        host_pages = 0 if cfg.host_factor == 0 else pool_pages(
            _rows_for(group, cfg.host_factor, "host_factor"), cfg.host_factor, page)
        if cuda_pages + host_pages > MAX_POOL_PAGES:
            raise ValueError(
                f"cuda_factor={cfg.cuda_factor} and host_factor={cfg.host_factor} ask for "
                f"{cuda_pages} + {host_pages} pages of {page} rows for the {dtype} x {width} "
                f"pool; page ids are int32, so at most {MAX_POOL_PAGES}: use factors near 1 "
                f"(a pool holds factor x the balanced rows)")
        layouts.append(PoolLayout(dtype, width, page, cuda_pages, host_pages))
    return tuple(layouts)


def _new_pool(lay: PoolLayout, device: torch.device) -> Pool:
    cuda = _allocate(lay, lay.cuda_pages, "cuda_factor", device=device)
    if lay.host_pages == 0:
        # No host tier: a one-row placeholder on the device, so every launch has a valid
        # pointer and nothing pinned is allocated.
        host = torch.empty(1, lay.width, dtype=lay.dtype, device=device)
    else:
        host = _allocate(lay, lay.host_pages, "host_factor", pin_memory=device.type == "cuda")
        host = host if device.type == "cuda" else host.to(device)
    free_pages, cursors = _fresh_free_lists(lay, device)
    return Pool(cuda, host, free_pages, cursors)


def _allocate(lay: PoolLayout, pages: int, factor: str, **where) -> torch.Tensor:
    """``pages`` pages of ``lay`` (uninitialised); a `MemoryError` naming the pool, its size
    and the factor that sized it when the allocator cannot give them."""
    rows = pages * lay.page_size
    size = rows * lay.width * lay.dtype.itemsize
    tier = "host" if factor == "host_factor" else "device"
    said = (f"the {lay.dtype} x {lay.width} stash pool's {tier} tier ({pages} pages of "
            f"{lay.page_size} rows, {size / 2**30:.3g} GiB) could not be allocated: a pool "
            f"holds {factor} times the balanced rows it stashes, so lower {factor} (near 1 "
            f"is the usual), or shrink the batch")
    device = where.get("device")
    # (traced by torch.compile, the allocator's own out-of-memory error stands for this check)
    total = None if torch.compiler.is_compiling() else \
        _memory_of(str(device) if device is not None else "cpu")
    if total is not None and size > total:  # refused whatever the allocator would promise
        raise PoolMemoryError(f"{said} (it is larger than all {total / 2**30:.3g} GiB of "
                              f"that memory)")
    try:
        return torch.empty(rows, lay.width, dtype=lay.dtype, **where)
    except RuntimeError as err:                 # torch.OutOfMemoryError is one
        text = str(err).lower()
        if not isinstance(err, torch.OutOfMemoryError) and "alloc" not in text \
                and "out of memory" not in text:
            raise
        raise PoolMemoryError(said) from err


@functools.lru_cache(maxsize=None)
def _memory_of(device: str) -> int | None:
    """Bytes of memory the device has in all (the host's for the CPU and pinned pools;
    ``None`` where it cannot be told): a pool larger than that can never be used, though an
    allocator that promises memory lazily (Linux, for the host) would hand it out. Asked
    once per device: a pool per layer is made at every step."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None
    return None


class PoolMemoryError(torch.OutOfMemoryError, MemoryError):
    """A stash pool the allocator could not give: an out-of-memory error (code that catches
    ``torch.OutOfMemoryError`` or ``MemoryError`` sees it) whose message names the pool, its
    size and the factor that sized it."""


def _fresh_free_lists(lay: PoolLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Stacks are popped from the top, so storing ids descending hands out page 0 first. Built
    # on the device by kernels, with no copy from the host: a layer's own pool is made inside
    # the step, where a host-to-device copy would stop the host and break graph capture.
    total = lay.cuda_pages + lay.host_pages
    ids = torch.arange(total - 1, -1, -1, dtype=torch.int32, device=device)
    free_pages = torch.cat([ids[lay.host_pages:], ids[:lay.host_pages]])
    cursors = torch.zeros(4, dtype=torch.int32, device=device)
    for slot, value in ((layout.CUR_CUDA_FREE, lay.cuda_pages),
                        (layout.CUR_HOST_FREE, lay.host_pages)):
        cursors.narrow(0, slot, 1).fill_(value)     # a fill kernel (item assignment copies)
    return free_pages, cursors


def _new_tables(specs, page_size, device) -> dict[str, torch.Tensor]:
    return {s.name: empty_table(layout.table_size(s.capacity, page_size), device)
            for s in specs}


def reset(state: StashState) -> StashState:
    """A usable state from any state: initial page order, empty tables, flags and counts zero.

    A live ``state`` is consumed and its pool buffers are reused (no allocation). A consumed
    one (say, by a step that failed halfway) gets fresh pool buffers: another live state may
    still own its pools, and two live states must never share pages.

    Args:
        state: any `StashState`, live or consumed.

    Returns:
        A live `StashState` with the same layouts and specs, nothing held.
    """
    device = state.flags.device
    if state.consumed:
        pools = {lay.key: _new_pool(lay, device) for lay in state.layouts}
    else:
        state.consume("reset")
        for record in state.pending:      # their pages are gone: a late backward must raise
            record.status = "released"
            record.let_go()
        pools = {lay.key: Pool(state.pools[lay.key].cuda, state.pools[lay.key].host,
                               *_fresh_free_lists(lay, device)) for lay in state.layouts}
    return state.successor(
        pools=pools, tables=_new_tables(state.specs, state.page_size, device),
        flags=torch.zeros_like(state.flags),
        counts={c: torch.zeros_like(v) for c, v in state.counts.items()}, pending=())


# ----------------------------------------------------------------------------- MoE layers


STASHED = ("fc1_in", "act_in")   # what a layer may stash, in stash order; given back in reverse


def kept_whole(lay: PoolLayout, rows: int) -> bool:
    """Whether a pool of the layer's own with layout ``lay`` would hold at least the ``rows``
    of the buffer it replaces: paging into it would then cost a copy each way and hold more,
    never less, so the layer keeps the buffer instead (freed at the same point of its
    backward). On one device the buffer has at most ``align(T * k)`` rows (``T * k`` rounded
    up to 16) and the pool ``cuda_factor * T * k`` rounded up to pages, plus a slack page: with
    pages of 8 rows or more that is any ``cuda_factor >= 1`` (the default is 1.10), and a
    little below at small ``T * k``; across ranks, about ``cuda_factor >= capacity_factor``
    (the largest of ``layer_factors`` where they are set).
    Static: from shapes and the config alone."""
    return lay.host_pages == 0 and lay.cuda_pages * lay.page_size >= rows


def is_kept_whole(state: StashState, name: str) -> bool:
    """Whether the stashed tensor ``name`` of ``state`` is kept whole rather than paged: its
    pool is its layer's own and `kept_whole` against its buffer's rows."""
    lay = state.layer_pools.get(name)
    return lay is not None and kept_whole(lay, state.spec(name).capacity)


def stashed_names(group_size: int = 1) -> tuple:
    """What a layer stashes, in stash order.

    On one device only ``act_in`` (the fc1 input rows are a gather of the layer input ``x``, so
    backward keeps ``x``, ``[T, H]``, which the router's backward usually keeps anyway, and
    gathers them again instead of paging them: the same bits, one copy fewer each way); across
    ranks (``group_size > 1``) both, since gathering the fc1 input again would mean another
    all-to-all.

    Args:
        group_size: the ranks the experts are spread over (1 on one device).

    Returns:
        ``("act_in",)`` on one device, ``("fc1_in", "act_in")`` across ranks.

    Raises:
        ValueError: ``group_size`` is not a positive integer.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer (the ranks the experts are "
                         f"spread over; 1 on one device), got {group_size!r}")
    return STASHED if group_size > 1 else ("act_in",)


def stash_widths(hidden: int, ffn: int) -> dict[str, int]:
    """Row width of each tensor in `STASHED` for experts of hidden size ``hidden``, FFN ``ffn``.

    The fc2 input ``z`` is not stashed: backward recomputes it from ``act_in`` in the fused
    SwiGLU kernel, and the routing weights stay out of pages (``[C]`` fp32, kept whole), so a
    valid row stashes ``H + 2F`` elements.
    """
    return {"fc1_in": hidden, "act_in": 2 * ffn}


def moe_stash_specs(layer: str, params, *, tokens: int, top_k: int, cfg: StashConfig,
                    dtype=None, observed_rows: int | None = None,
                    group_size: int = 1) -> list[StashSpec]:
    """The tensors one capacity-path layer stashes.

    `stashed_names`: the activation input, and across ranks the fc1 input too; each
    ``[capacity, width]``, balanced reference ``T * k`` rows (what one rank's experts receive
    under even routing, with or without expert parallelism).

    Args:
        layer: the layer's name (``"moe0"``), the prefix of its specs' names.
        params: the layer's dict; only ``w_gate_up``'s shape ``[E, H, 2F]`` and dtype are read.
        tokens: ``T``, the tokens the layer routes (on this rank).
        top_k: experts chosen per token, ``k``.
        cfg: the `StashConfig`; its capacity factor sizes the rows, its ``stash_precision``
            the activation input's dtype.
        dtype: the experts' dtype (default ``w_gate_up``'s).
        observed_rows: rows seen in a profiling pass (for negative pool factors).
        group_size: the ranks the experts are spread over (1 on one device).

    Returns:
        A list of `StashSpec`, one per name of `stashed_names`: ``f"{layer}/act_in"``
            (width ``2F``; ``uint8`` bytes with ``stash_precision="fp8"``) and, across ranks,
            ``f"{layer}/fc1_in"`` (width ``H``).
    """
    _, hidden, two_ffn = params["w_gate_up"].shape
    dtype = dtype or params["w_gate_up"].dtype
    rows = capacity_rows(tokens, top_k, cfg, group_size, layer).rows
    widths = stash_widths(hidden, two_ffn // 2)
    dtypes = {"fc1_in": dtype, "act_in": stash_dtype(cfg, dtype)}
    return [StashSpec(f"{layer}/{name}", widths[name], dtypes[name], rows, tokens * top_k,
                      observed_rows, layer) for name in stashed_names(group_size)]


def stash_dtype(cfg: StashConfig, dtype: torch.dtype) -> torch.dtype:
    """What the activation input's pages hold: the experts' dtype, or with
    ``stash_precision="fp8"`` the bytes of float8 e4m3 rows (``uint8``: the page kernels copy
    bytes)."""
    return torch.uint8 if cfg.stash_precision == "fp8" else dtype
