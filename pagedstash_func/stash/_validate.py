"""`validate_state`: the page invariants of a `StashState`, checked on the host.

A state that came from a file (or anywhere not made by this library's own calls) must pass
this before any kernel sees it: a repeated or out-of-range page id makes a kernel write where
it must not (wrong gradients, or a crash with the Triton backend). The invariant: per pool,
the ids on the free stacks below their cursors plus the ids held by the page tables are all of
the pool's pages, each exactly once; cursors, counts and flags in range; shapes and dtypes as
the layouts and specs say. Every violation is a `ValueError` naming the field.
"""

from __future__ import annotations

import collections
import math

import torch
import torch.utils._pytree as pytree

from .. import kernels
from ._pools import MAX_POOL_PAGES
from ._state import StashState

L = kernels.layout


def validate_state(state: StashState, where: str = "state", between_steps: bool = False) -> None:
    """Raise `ValueError` naming the first field of ``state`` that breaks an invariant.

    Reads every bookkeeping tensor on the host (a sync): for loaded files and debugging,
    never inside a step.

    Args:
        state: the `StashState` to check (not consumed by the check).
        where: how the message names the state (its fields appear as
            ``f"{where}.flags"``, ``f"{where}.tables['moe0/act_in']"``, ...).
        between_steps: also require that no page is held (true of every state `save_step`
            writes).

    Raises:
        ValueError: a field breaks an invariant (a page id repeated, lost or out of range,
            cursors, counts or flags out of range, a shape or dtype other than the layouts and
            specs say); the message names the field.
    """
    _check(isinstance(state, StashState), where, f"is a {type(state).__name__}, not a StashState")
    _check(state.page_size >= 1, f"{where}.page_size", f"is {state.page_size}")
    _check_memory(state, where)
    _check_layers(state, where)
    _tensor(state.flags, f"{where}.flags", (L.NUM_FLAGS,), torch.int32)
    _check(set(state.flags.tolist()) <= {0, 1}, f"{where}.flags", "holds values other than 0/1")
    held = {lay.key: [] for lay in state.layouts}
    own = state.layer_pools
    unknown = sorted(set(own) - {s.name for s in state.specs})
    _check(not unknown, f"{where}.layer_pools", f"name tensors the state does not stash: "
                                                f"{unknown}")
    _check(not (own and state.layouts), f"{where}.layer_pools",
           "are set, but the state also has shared pools (one scope per state)")
    for spec in state.specs:
        field = f"{where}.tables[{spec.name!r}]"
        if spec.name in own:      # pool_scope="layer": the pool lives with the layer's call
            _check_own_pool(state, spec, own[spec.name], field, between_steps)
            continue
        lay = next((lay for lay in state.layouts if lay.key == (spec.dtype, spec.width)), None)
        _check(lay is not None, field, f"stashes {spec.dtype} rows of width {spec.width}, "
                                       f"for which the state has no pool")
        pages = _table_pages(state, spec, lay, field)
        _check(not (between_steps and pages), field, "holds pages between steps")
        held[lay.key] += pages
    for lay in state.layouts:
        _check_pool(state, lay, held[lay.key], f"{where}.pools[{lay.name}]")
    for name, counts in state.counts.items():
        field = f"{where}.counts[{name!r}]"
        _check(isinstance(counts, torch.Tensor) and counts.dtype == torch.int64, field,
               "must be an int64 tensor")
        _check(bool((counts >= 0).all()), field, "holds negative counts")


def _check_own_pool(state, spec, lay, field, between_steps) -> None:
    """A table paged in its layer's own pool: its layout must be the spec's, its page ids
    inside that pool and each held once (the pool itself is not in the state)."""
    _check(isinstance(lay.cuda_pages, int) and not isinstance(lay.cuda_pages, bool)
           and 1 <= lay.cuda_pages <= MAX_POOL_PAGES, field,
           f"has a pool of its layer's own of {lay.cuda_pages} pages; it needs 1 to "
           f"{MAX_POOL_PAGES} (page ids are int32)")
    _check((lay.dtype, lay.width, lay.page_size, lay.host_pages) ==
           (spec.dtype, spec.width, state.page_size, 0), field,
           f"has a pool of its layer's own of {lay.dtype} x {lay.width}, page {lay.page_size}, "
           f"{lay.host_pages} host pages; the spec needs {spec.dtype} x {spec.width}, page "
           f"{state.page_size}, no host pages")
    pages = _table_pages(state, spec, lay, field)
    _check(not (between_steps and pages), field, "holds pages between steps")
    _check(len(set(pages)) == len(pages), field, f"holds page ids {pages}, some twice")


def _check_memory(state, where) -> None:
    """Every leaf a contiguous tensor with storage of its own: a kernel writing through one
    must never change another (an edited file can alias them)."""
    seen = {}
    for i, t in enumerate(pytree.tree_leaves(state)):
        _check(isinstance(t, torch.Tensor), f"{where} leaf {i}", f"is a {type(t).__name__}, not "
                                                                  f"a tensor")
        _check(t.is_contiguous(), f"{where} leaf {i}", "is not contiguous")
        if t.numel():
            key = (t.device, t.untyped_storage().data_ptr())
            _check(key not in seen, f"{where} leaf {i}", f"shares memory with leaf {seen.get(key)}")
            seen[key] = i


def _check_layers(state, where) -> None:
    for info in state.layers:
        field = f"{where}.layers[{info.name!r}]"
        _check(info.expert_ranks >= 1 and info.num_experts % info.expert_ranks == 0, field,
               f"splits {info.num_experts} experts over {info.expert_ranks} ranks")
        for stat, size in (("expert_load", info.num_experts), ("rows", 1)):
            counts = state.counts.get(f"{info.name}/{stat}")
            _check(counts is not None and tuple(counts.shape) == (size,),
                   f"{where}.counts[{info.name + '/' + stat!r}]",
                   f"must be [{size}] int64, got "
                   f"{None if counts is None else list(counts.shape)}")


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise ValueError(f"{field} {problem}")


def _tensor(t, field, shape, dtype) -> None:
    _check(isinstance(t, torch.Tensor), field, f"is a {type(t).__name__}, not a tensor")
    _check(tuple(t.shape) == tuple(shape) and t.dtype == dtype, field,
           f"is {list(t.shape)} {t.dtype}; expected {list(shape)} {dtype}")


def _table_pages(state, spec, lay, field) -> list[int]:
    """The page ids the table holds, after checking its header and id ranges."""
    table = state.tables[spec.name]
    _tensor(table, field, (L.table_size(spec.capacity, state.page_size),), torch.int32)
    values = table.tolist()
    rows, pages, ncuda = values[L.TAB_ROWS], values[L.TAB_PAGES], values[L.TAB_CUDA_PAGES]
    if rows == L.NOTHING_HELD:
        _check(pages == 0 and ncuda == 0, field, f"holds nothing but counts {pages} pages")
        return []
    _check(0 <= rows <= spec.capacity, field, f"says {rows} rows held, outside [-1, "
                                              f"{spec.capacity}]")
    _check(pages == math.ceil(rows / state.page_size), field,
           f"holds {rows} rows in {pages} pages (pages of {state.page_size} rows)")
    _check(0 <= ncuda <= pages, field, f"says {ncuda} of its {pages} pages are device pages")
    ids = values[L.HEADER:L.HEADER + pages]
    device_ok = all(0 <= p < lay.cuda_pages for p in ids[:ncuda])
    host_ok = all(lay.cuda_pages <= p < lay.cuda_pages + lay.host_pages for p in ids[ncuda:])
    _check(device_ok and host_ok, field, f"holds page ids {ids} outside its pool's ranges")
    return ids


def _check_pool(state, lay, held, field) -> None:
    pool = state.pools[lay.key]
    _tensor(pool.cuda, f"{field}.cuda", (lay.cuda_pages * lay.page_size, lay.width), lay.dtype)
    host_shape = (lay.host_pages * lay.page_size, lay.width) if lay.host_pages \
        else (1, lay.width)
    _tensor(pool.host, f"{field}.host", host_shape, lay.dtype)
    _tensor(pool.free_pages, f"{field}.free_pages", (lay.cuda_pages + lay.host_pages,),
            torch.int32)
    _tensor(pool.cursors, f"{field}.cursors", (4,), torch.int32)
    cuda_free, host_free, spare2, spare3 = pool.cursors.tolist()
    _check(0 <= cuda_free <= lay.cuda_pages and 0 <= host_free <= lay.host_pages,
           f"{field}.cursors", f"are {[cuda_free, host_free]}, outside [0, "
                               f"{[lay.cuda_pages, lay.host_pages]}]")
    _check(spare2 == spare3 == 0, f"{field}.cursors",
           f"have {[spare2, spare3]} in their spare slots (must be 0)")
    free = pool.free_pages.tolist()
    free = free[:cuda_free] + free[lay.cuda_pages:lay.cuda_pages + host_free]
    _check(all(0 <= p < lay.cuda_pages for p in free[:cuda_free]) and
           all(lay.cuda_pages <= p < lay.cuda_pages + lay.host_pages for p in free[cuda_free:]),
           f"{field}.free_pages", "hold ids outside their stack's range")
    seen = collections.Counter(free + held)
    twice = sorted(p for p, n in seen.items() if n > 1)
    lost = sorted(set(range(lay.cuda_pages + lay.host_pages)) - set(seen))
    _check(not twice and not lost, f"{field}.free_pages",
           f"and the page tables give pages {twice} twice and lose pages {lost}: every page "
           f"must be free or held exactly once")
