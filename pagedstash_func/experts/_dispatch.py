"""The dispatch plan: which row of the grouped expert buffer each (token, slot) pair takes.

A *plan* maps the ``P = T * k`` (token, slot) pairs onto the rows of one grouped expert buffer
of ``capacity`` rows (`_experts.MoEExperts` gathers and sums along it). Kept pairs are packed
at the front, grouped by expert in expert order and, inside an expert, in pair order; the rest
of the buffer is unused. Everything is computed with
sorts, searches and gathers on the device: no host read, except that the exact path reads the
number of valid pairs once to size its buffer.

Drop order (capacity path only; any drop makes the runner rerun the step dropless, so it only
has to be fixed and documented): inside an expert rank, pairs are ranked by (expert, token,
slot); those at rank-local position ``>= budget`` are dropped. So an overloaded rank keeps its
lower-numbered experts whole and drops the latest tokens of its highest-numbered experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Plan(NamedTuple):
    """Where each pair goes. All tensors are on the device."""

    pair_row: torch.Tensor   # [P] int64: buffer row of each pair, ``capacity`` if not placed
    row_pair: torch.Tensor   # [capacity] int64: pair in each row, ``P`` for an unused row
    row_token: torch.Tensor  # [capacity] int64: token of each row (any valid token if unused)
    offs: torch.Tensor       # [E] int32: end row of each expert's group (grouped-GEMM offsets)
    n_valid: torch.Tensor    # [1] int32: rows in use (a prefix of the buffer)
    expert_load: torch.Tensor  # [E] int64: pairs routed to each expert, padding excluded
    over_budget: torch.Tensor  # 0-d bool: some rank received more pairs than its budget


def make_plan(ids: torch.Tensor, num_experts: int, expert_ranks: int, budget: int,
              capacity: int) -> Plan:
    """Plan the pairs ``ids [T, k]`` (canonical: padding is ``E``) onto a buffer.

    Args:
        expert_ranks: ``R``; experts are split into ``R`` contiguous groups of ``E / R``.
        budget: rows each rank may use; pairs past it are dropped.
        capacity: rows of the buffer (``>= R * budget`` is never needed: kept rows are packed).
    """
    device = ids.device
    pairs = ids.numel()
    per_rank = num_experts // expert_ranks
    key = ids.reshape(-1)
    order = torch.argsort(key, stable=True)                      # [P] pairs by expert
    sorted_key = key[order]
    edges = torch.arange(num_experts + 1, device=device)
    bounds = torch.searchsorted(sorted_key, edges)                # [E+1] first sorted index
    expert_load = bounds[1:] - bounds[:-1]                        # [E]
    rank_edges = bounds[torch.arange(expert_ranks + 1, device=device) * per_rank]
    rank_start, rank_load = rank_edges[:-1], rank_edges[1:] - rank_edges[:-1]
    kept_per_rank = rank_load.clamp(max=budget)
    rank_base = torch.cumsum(kept_per_rank, 0) - kept_per_rank   # [R] packed start of a rank

    position = torch.arange(pairs, device=device)
    rank = (sorted_key // per_rank).clamp(max=expert_ranks - 1)  # padding: masked out below
    in_rank = position - rank_start[rank]
    keep = (sorted_key < num_experts) & (in_rank < budget)
    dest = rank_base[rank] + in_rank
    pair_row = torch.empty_like(dest)
    pair_row[order] = torch.where(keep, dest, capacity)           # a permutation: no collisions
    # Unplaced pairs scatter to distinct rows past the buffer, so every index is written once
    # (index_put with repeated indices has no defined winner).
    row_pair = torch.full((capacity + pairs,), pairs, dtype=torch.int64, device=device)
    row_pair[torch.where(keep, dest, capacity + position)] = order
    expert_rank = torch.arange(num_experts, device=device) // per_rank
    offs = rank_base[expert_rank] + (bounds[1:] - rank_start[expert_rank]).clamp(0, budget)
    row_pair = row_pair[:capacity]
    # Unused rows (past n_valid) point at the last token: a valid address that no consumer
    # reads, so the gather needs no padded copy of x.
    row_token = (row_pair // ids.shape[1]).clamp(max=max(ids.shape[0] - 1, 0))
    return Plan(pair_row=pair_row, row_pair=row_pair, row_token=row_token,
                offs=offs.to(torch.int32), n_valid=kept_per_rank.sum().reshape(1).int(),
                expert_load=expert_load, over_budget=(rank_load > budget).any())
