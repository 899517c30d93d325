"""run_step gathers the flags over the world: one rank over budget reruns every rank."""

import pytest
import torch
import torch.distributed as dist
from worlds import no_failures, spawn_world

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 32


def _loss(params, batch):
    ids = batch["ids"]
    w = torch.full(ids.shape, 0.5, dtype=torch.float64)
    return psf.moe(params, batch["x"], top_k=K, routing=(ids, w)).pow(2).mean()


def one_rank_over_budget(rank, world):
    g = torch.Generator().manual_seed(0)
    params = psf.moe_init(E, H, F, generator=g, dtype=torch.float64)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    if rank == 0:       # every pair to rank 0's experts: over budget there only
        ids = torch.stack([torch.zeros(T, dtype=torch.int64), torch.ones(T, dtype=torch.int64)],
                          1)
    else:               # even spread
        ids = (torch.arange(T * K) % E).reshape(T, K)
    batch = {"x": x, "ids": ids}
    step = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=1.0, paged_stash=True,
                                                  page_size=8, expert_ranks=2))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    exact = torch.func.grad(_loss)(params, batch)
    same = all(torch.allclose(res.grads[k], exact[k], rtol=1e-12, atol=1e-12) for k in exact)
    local_over = any(load > layer.budget for layer in res.report.layers
                     for load in layer.rank_load)
    return res.report.reran, local_over, same, res.report.flagged_by


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_one_rank_over_budget_reruns_all_ranks():
    values = spawn_world(2, [one_rank_over_budget])["one_rank_over_budget"]
    no_failures(values)
    assert values == [(True, True, True, (0,)), (True, False, True, (0,))]
