"""Expert parallelism: the plan of an exchange across ranks, its transports, its route.

``R`` ranks of a process group each hold ``T`` tokens and ``E / R`` experts (rank ``r`` owns
experts ``[r E/R, (r+1) E/R)``). A pair routed to expert ``e`` is sent to rank ``e // (E/R)``.

The capacity path never reads a count on the host. Counts travel on the device (an all-gather
of ``[R]`` per rank, so every rank knows every source's count for every destination); each
destination takes at most ``budget`` rows, shared out in source-rank order and then pair order;
each source keeps its share, drops the rest and raises ``over_budget``. Rows travel by one of
two transports with the same bits: `SymmetricSlots` (NVSHMEM, `_symmetric`: only the kept rows,
packed, split sizes on the device) or `FixedSlots` (``budget`` rows from every source to every
destination, one ``all_to_all_single`` of equal splits; gloo on the CPU, CUDA without NVSHMEM).
Both are sync-free and graph-capturable. The exact path reads the counts once and sends exactly
the routed rows (`ExactSplits`, variable splits known on the host).

Every collective runs inside an ``autograd.Function`` (`ExchangePlan`, `MoEExperts`), where
``torch.func`` has unwrapped the tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import kernels
from . import _symmetric
from ..experts._experts import after_of, gather_or_zero
from ..core._function import fast_apply

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); 2.11 has only that.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FixedSlots(NamedTuple):
    """Transport with ``slots`` rows per (source, destination) pair: equal splits, one
    ``all_to_all_single`` (NCCL or gloo). Every transport has the same four methods; ``shares``
    is the route's ``[2, R]`` int64 (rows sent to each destination, received from each source),
    which only `SymmetricSlots` reads."""

    group: object

    def gather(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The send rows ``t[index]``."""
        return t.index_select(0, index)

    def exchange(self, send: torch.Tensor, shares=None) -> torch.Tensor:
        """``[R * slots, ...]`` laid out by destination -> the same laid out by source."""
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send.contiguous(), group=self.group)
        return out

    reverse = exchange     # equal splits: the way back is the same exchange


class ExactSplits(NamedTuple):
    """Transport of exactly the routed rows: split sizes known on the host (exact path)."""

    group: object
    send_splits: tuple     # rows this rank sends to each destination
    recv_splits: tuple     # rows this rank receives from each source

    def gather(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, index)

    def exchange(self, send: torch.Tensor, shares=None) -> torch.Tensor:
        out = send.new_empty(sum(self.recv_splits), *send.shape[1:])
        dist.all_to_all_single(out, send.contiguous(), list(self.recv_splits),
                               list(self.send_splits), group=self.group)
        return out

    def reverse(self, send: torch.Tensor, shares=None) -> torch.Tensor:
        out = send.new_empty(sum(self.send_splits), *send.shape[1:])
        dist.all_to_all_single(out, send.contiguous(), list(self.send_splits),
                               list(self.recv_splits), group=self.group)
        return out


class SymmetricSlots(NamedTuple):
    """Transport through NVSHMEM symmetric memory (`_symmetric`): only the kept rows travel,
    packed by destination on the way out and by source on arrival, with split sizes that stay
    on the device. The receive side holds ``budget`` rows, not ``R * budget``. Rows arrive in
    the order fixed slots give them (source, then pair), so both transports give the same
    grouped rows and the same bits."""

    group: object
    send_rows: int         # S: rows of the send layout (every pair, at most)
    recv_rows: int         # the budget

    def gather(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``t[index]``, written straight into the symmetric send buffer."""
        out = _symmetric.workspace(self.group).send_view(index.numel(), t.shape[1:], t.dtype)
        if out.is_contiguous():
            return torch.index_select(t, 0, index, out=out)
        return out.copy_(t.index_select(0, index).reshape(out.shape))

    def exchange(self, send: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
        return _symmetric.workspace(self.group).exchange(send, shares[0], self.recv_rows)

    def reverse(self, send: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
        return _symmetric.workspace(self.group).exchange(send, shares[1], self.send_rows)


def capacity_transport(group, transport: str, pairs: int, budget: int):
    """The capacity path's transport object: `SymmetricSlots` for ``"nvshmem"``, else
    `FixedSlots` (the plan and the layer's route both take it from here)."""
    if transport == "nvshmem":
        return SymmetricSlots(group, pairs, budget)
    return FixedSlots(group)


class ExchangeRoute(NamedTuple):
    """Rows across ranks. The sender lays pairs out in send slots (by destination); the
    receiver groups what it got by its local expert. Each method is one direction of the
    layer's data movement (the same four as `LocalRoute`); the transport's results are read
    right away (a symmetric receive buffer is reused by the next exchange)."""

    send_token: torch.Tensor   # [S] token of each send slot (a valid token if empty)
    pair_send: torch.Tensor    # [P] send slot of each kept pair (S if dropped or padding)
    send_pair: torch.Tensor    # [S] pair in each send slot (P if empty)
    row_recv: torch.Tensor     # [C] received slot of each grouped row
    recv_row: torch.Tensor     # [S_recv] grouped row of each received slot (clamped)
    shares: torch.Tensor       # [2, R] int64 rows sent to each rank, received from each rank
    transport: object

    def rows_of(self, t, static, n_valid, after=None):
        """``[T, H]`` -> ``[C, H]`` across ranks; as on one device, rows ``>= n`` are left
        unwritten (the received slots sort empty ones last, so the first ``n`` hold them all).
        ``after``: as `Routed.rows_of` takes it (what a backward's gather must follow)."""
        move = self.transport
        received = move.exchange(move.gather(t, self.send_token), self.shares)
        return kernels.gather_rows(received, self.row_recv, n_valid, static.backend,
                                   **after_of(static, after))

    def tokens_of(self, rows, static):
        move = self.transport
        back = move.reverse(move.gather(rows, self.recv_row), self.shares)
        return kernels.gather_sum(back, self.pair_send, static.top_k, static.backend)

    def weights_of(self, w_pairs, static):
        received = self.transport.exchange(gather_or_zero(w_pairs, self.send_pair),
                                           self.shares)
        return received.index_select(0, self.row_recv)

    def weight_grads_of(self, d_w_rows, static):
        back = self.transport.reverse(d_w_rows.index_select(0, self.recv_row), self.shares)
        return gather_or_zero(back, self.pair_send)


class PlanStatic(NamedTuple):
    """Static arguments of `ExchangePlan`."""

    num_experts: int
    group: object
    budget: int = 0              # rows a destination takes (capacity path)
    splits: tuple | None = None  # (send_splits, recv_splits) for the exact path
    transport: str = "fixed"     # capacity path: "fixed" slots or "nvshmem" (`_symmetric`)


def group_size(group) -> int:
    return dist.get_world_size(group)


@fast_apply
class ExchangeCounts(torch.autograd.Function):
    """``ids [T, k]`` (canonical: padding is ``E``), ``signature`` (ints) -> ``(sent [R],
    received [R], signatures [R, len(signature)])`` int64 on the device, exchanged with one
    all-to-all (the exact path reads them on the host). Each rank's ``signature`` (what sizes
    and types the rows it will exchange) travels with its counts, so every rank can refuse a
    mismatch before any row moves."""

    @staticmethod
    def forward(ids, static, signature=()):
        ranks = group_size(static.group)
        dest, order, bounds = _by_destination(ids, static.num_experts, ranks)
        sent = (bounds[1:] - bounds[:-1])[:ranks]
        mine = torch.tensor(list(signature), dtype=sent.dtype, device=sent.device)
        packed = torch.cat([sent[:, None], mine.expand(ranks, -1)], 1).contiguous()
        got = torch.empty_like(packed)
        dist.all_to_all_single(got, packed, group=static.group)     # row r: source r's
        return sent.contiguous(), got[:, 0].contiguous(), got[:, 1:].contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output)


@fast_apply
class ExchangePlan(torch.autograd.Function):
    """``ids [T, k]`` (canonical) -> ``(*route, offs, n_valid, over_budget, expert_load)``:
    the `ExchangeRoute` tensors in field order, the group ends ``[E/R]`` int32 of the grouped
    rows, the rows received ``[1]`` int32, ``over_budget`` (0-d bool, the same on every rank)
    and the pairs this rank routed to each expert ``[E]`` int64.

    Collectives: on the capacity path an all-gather of every rank's ``[R]`` counts (so the
    shares are computed on the device, identically everywhere) and an exchange of the local
    expert id of every send slot over the transport; with exact splits that exchange only.
    Nothing is read on the host.
    """

    @staticmethod
    def forward(ids, static):
        return tuple(_plan(ids, static))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output)


def _by_destination(ids, num_experts, ranks):
    """``(dest [P], order [P], bounds [R + 2])``: pairs stably sorted by destination rank
    (padding is destination ``R``), and where each destination's run starts."""
    flat = ids.reshape(-1)
    per_rank = num_experts // ranks
    dest = torch.where(flat < num_experts, flat // per_rank, ranks)
    order = torch.argsort(dest, stable=True)
    edges = torch.arange(ranks + 2, device=ids.device)
    return dest, order, torch.searchsorted(dest[order], edges)


def _plan(ids, static):
    group, num_experts = static.group, static.num_experts
    ranks, me = group_size(group), dist.get_rank(group)
    per_rank = num_experts // ranks
    tokens, top_k = ids.shape
    pairs, flat, device = tokens * top_k, ids.reshape(-1), ids.device
    dest, order, bounds = _by_destination(ids, num_experts, ranks)
    sorted_dest = dest[order]
    counts = (bounds[1:] - bounds[:-1])[:ranks]
    position = torch.arange(pairs, device=device)
    if static.splits is None:       # capacity: shares of every destination's budget
        budget = static.budget
        all_counts = torch.empty(ranks * ranks, dtype=counts.dtype, device=device)
        all_gather_into(all_counts, counts.contiguous(), group=group)
        all_counts = all_counts.view(ranks, ranks)                    # [source, destination]
        before = all_counts.cumsum(0) - all_counts
        shares = (budget - before).clamp(min=0).minimum(all_counts)   # [source, destination]
        share = shares[me]
        over_budget = (all_counts.sum(0) > budget).any()
        in_run = position - bounds[sorted_dest]
        to = sorted_dest.clamp(max=ranks - 1)
        kept = (sorted_dest < ranks) & (in_run < share[to])
        transport = capacity_transport(group, static.transport, pairs, budget)
        if static.transport == "nvshmem":       # packed by destination: kept rows only
            slot, slots = (share.cumsum(0) - share)[to] + in_run, pairs
        else:                                   # budget slots per destination
            slot, slots = to * budget + in_run, ranks * budget
        rows, shares = budget, torch.stack([share, shares[:, me]])
    else:                           # exact: every routed pair, packed by destination
        send_splits, recv_splits = static.splits
        kept = sorted_dest < ranks
        slot, slots = position, sum(send_splits)
        over_budget = torch.zeros((), dtype=torch.bool, device=device)
        transport, rows = ExactSplits(group, *static.splits), sum(recv_splits)
        shares = torch.stack([counts, counts])          # unused: the splits are on the host
    pair_send = torch.empty_like(position)
    pair_send[order] = torch.where(kept, slot, slots)
    send_pair = torch.full((slots + pairs,), pairs, dtype=torch.int64, device=device)
    send_pair[torch.where(kept, slot, slots + position)] = order
    send_pair = send_pair[:slots]
    send_token = (send_pair // top_k).clamp(max=max(tokens - 1, 0))
    send_expert = torch.where(send_pair < pairs, flat[send_pair.clamp(max=max(pairs - 1, 0))]
                              % per_rank, -1) if pairs else send_pair
    received = transport.exchange(send_expert, shares)
    if isinstance(transport, SymmetricSlots):
        # packed: only the first sum(shares[1]) received rows are real
        arrived = torch.arange(rows, device=device) < shares[1].sum()
        received = torch.where(arrived, received, -1)
    row_recv, recv_row, offs, n_valid = _group_received(received, per_rank, rows)
    load = torch.searchsorted(flat.sort().values, torch.arange(num_experts + 1, device=device))
    route = (send_token, pair_send, send_pair, row_recv, recv_row, shares)
    return (*route, offs, n_valid, over_budget, load[1:] - load[:-1])


def _group_received(received_expert, per_rank, rows):
    """The received slots grouped by local expert (then by source, then slot): ``(row_recv
    [rows], recv_row [S_recv], offs [E/R], n_valid [1])``. Empty slots (expert ``-1``) sort
    last; fewer than ``rows`` are ever valid, so the first ``rows`` hold them all."""
    key = torch.where(received_expert >= 0, received_expert, per_rank)
    order = torch.argsort(key, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    offs = torch.searchsorted(key[order], torch.arange(per_rank, device=key.device), right=True)
    n_valid = (received_expert >= 0).sum().reshape(1).int()
    return order[:rows], inverse.clamp(max=max(rows - 1, 0)), offs.int(), n_valid
