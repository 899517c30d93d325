"""run_step reads the flags after a max all-reduce: one rank over budget reruns every rank."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 32


def _loss(params, batch):
    ids = batch["ids"]
    w = torch.full(ids.shape, 0.5, dtype=torch.float64)
    return psf.moe(params, batch["x"], top_k=K, routing=(ids, w)).pow(2).mean()


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        params = psf.moe_init(E, H, F, generator=g, dtype=torch.float64)
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        if rank == 0:       # every pair to rank 0's experts: over budget there only
            ids = torch.stack([torch.zeros(T, dtype=torch.int64),
                               torch.ones(T, dtype=torch.int64)], 1)
        else:               # even spread
            ids = (torch.arange(T * K) % E).reshape(T, K)
        batch = {"x": x, "ids": ids}
        step = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=1.0, paged_stash=True,
                                                      page_size=8, expert_ranks=2))
        res = psf.run_step(step, params, batch, step.init(params, batch))
        exact = torch.func.grad(_loss)(params, batch)
        same = all(torch.allclose(res.grads[k], exact[k], rtol=1e-12, atol=1e-12)
                   for k in exact)
        local_over = any(load > layer.budget for layer in res.report.layers
                         for load in layer.rank_load)
        out.put((rank, res.report.reran, local_over, same))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_one_rank_over_budget_reruns_all_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == [(0, True, True, True), (1, True, False, True)]
