"""The dispatch plan against a brute-force placement, and the gathers against plain loops."""

import pytest
import torch

from pagedstash_func._dispatch import Combine, Dispatch, make_plan


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


def test_dispatch_and_combine_are_gathers_with_exact_gradients():
    experts, tokens, k, hidden = 4, 6, 2, 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, experts + 1, (tokens, k), generator=g)
    plan = make_plan(ids, experts, 1, tokens * k, tokens * k)
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(tokens * k, dtype=torch.float64, generator=g, requires_grad=True)
    x_rows, w_rows = Dispatch.apply(x, w, plan.pair_row, plan.row_pair, k)
    for row, pair in enumerate(plan.row_pair.tolist()):
        if pair < tokens * k:
            assert torch.equal(x_rows[row], x[pair // k]) and w_rows[row] == w[pair]
        else:
            assert not x_rows[row].any() and w_rows[row] == 0
    y = Combine.apply(x_rows * 2, plan.pair_row, plan.row_pair, k)
    valid = (ids < experts).double()
    torch.testing.assert_close(y, 2 * x * valid.sum(1, keepdim=True), rtol=0, atol=0)
    assert torch.autograd.gradcheck(
        lambda x, w: Dispatch.apply(x, w, plan.pair_row, plan.row_pair, k), (x, w))
    rows = torch.randn(tokens * k, hidden, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda r: Combine.apply(r, plan.pair_row, plan.row_pair, k), (rows,))
