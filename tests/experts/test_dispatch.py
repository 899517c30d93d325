"""The dispatch plan against a brute-force placement."""

import pytest
import torch

from pagedstash_func.experts._dispatch import make_plan


def brute_force_plan(ids, num_experts, ranks, budget):
    """Rows by the documented rule: per rank, pairs ranked by (expert, token, slot); the first
    ``budget`` are kept, packed rank after rank. Returns {pair: row}, offsets, n_valid."""
    per_rank = num_experts // ranks
    flat = ids.reshape(-1).tolist()
    placed, offs, row = {}, [], 0
    for r in range(ranks):
        kept = 0
        for e in range(r * per_rank, (r + 1) * per_rank):
            for p, pe in enumerate(flat):
                if pe == e and kept < budget:
                    placed[p] = row
                    row += 1
                    kept += 1
            offs.append(row)
    return placed, offs, row


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ranks, budget", [(1, 64), (2, 7), (3, 5), (6, 2)])
def test_plan_matches_brute_force(seed, ranks, budget):
    experts, tokens, k = 6, 13, 2
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts + 1, (tokens, k), generator=g)    # E = padding
    capacity = min(ranks * budget, tokens * k)
    plan = make_plan(ids, experts, ranks, budget, capacity)
    placed, offs, n_valid = brute_force_plan(ids, experts, ranks, budget)
    pairs = tokens * k
    assert plan.offs.tolist() == offs and plan.n_valid.tolist() == [n_valid]
    assert plan.pair_row.tolist() == [placed.get(p, capacity) for p in range(pairs)]
    row_pair = [pairs] * capacity
    for p, r in placed.items():
        row_pair[r] = p
    assert plan.row_pair.tolist() == row_pair
    assert plan.expert_load.tolist() == torch.bincount(ids.reshape(-1),
                                                       minlength=experts + 1)[:experts].tolist()
    per_rank = experts // ranks
    rank_load = [int(((ids >= r * per_rank) & (ids < (r + 1) * per_rank)).sum())
                 for r in range(ranks)]
    assert bool(plan.over_budget) == any(load > budget for load in rank_load)


def test_rows_name_their_tokens_and_unused_rows_a_valid_one():
    experts, tokens, k = 4, 5, 3
    ids = torch.randint(0, experts + 1, (tokens, k), generator=torch.Generator().manual_seed(2))
    capacity = tokens * k + 7                       # more rows than pairs: some unused
    plan = make_plan(ids, experts, 2, 64, capacity)
    n = int(plan.n_valid)
    for row in range(capacity):
        pair = int(plan.row_pair[row])
        if row < n:
            assert int(plan.row_token[row]) == pair // k
        else:
            assert pair == tokens * k and 0 <= int(plan.row_token[row]) < tokens
