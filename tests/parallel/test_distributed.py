"""The flag rule: run_step reduces its flags over every rank the step communicates with (its
expert-parallel layers' group, or the group= it is given), and over no one else; a step that
communicates with no one decides alone, so a lone rank's step never waits."""

import datetime
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from worlds import free_port, no_failures, spawn_world

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 32

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def _loss(params, batch):
    ids = batch["ids"]
    w = torch.full(ids.shape, 0.5, dtype=torch.float64)
    return psf.moe(params, batch["x"], top_k=K, routing=(ids, w)).pow(2).mean()


def _skewed_batch(rank):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    if rank == 0:       # every pair to the first virtual rank's experts: over budget there only
        ids = torch.stack([torch.zeros(T, dtype=torch.int64), torch.ones(T, dtype=torch.int64)],
                          1)
    else:               # even spread
        ids = (torch.arange(T * K) % E).reshape(T, K)
    return {"x": x, "ids": ids}


def local_steps_decide_alone(rank, world):
    """No psf.moe call names a group: each rank reads its own flags (rank 0 reruns, rank 1 does
    not); with run_step(group=WORLD) both do."""
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    batch = _skewed_batch(rank)
    step = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=1.0, paged_stash=True,
                                                  page_size=8, expert_ranks=2))
    alone = psf.run_step(step, params, batch, step.init(params, batch))
    together = psf.run_step(step, params, batch, alone.state, group=dist.group.WORLD)
    exact = torch.func.grad(_loss)(params, batch)
    same = all(torch.allclose(r.grads[k], exact[k], rtol=1e-12, atol=1e-12)
               for r in (alone, together) for k in exact)
    return (alone.report.reran, alone.report.flagged_by, together.report.reran,
            together.report.flagged_by, same)


def test_a_step_that_communicates_with_no_one_decides_alone():
    values = spawn_world(2, [local_steps_decide_alone])["local_steps_decide_alone"]
    no_failures(values)
    assert values == [(True, (0,), True, (0,), True), (False, (), True, (0,), True)]


def _ep_loss(group):
    def loss(params, batch):
        return psf.moe(params, batch["x"], top_k=K, group=group).pow(2).mean()
    return loss


def subgroup_loads(rank, world):
    """Four ranks as two expert-parallel groups {0, 1} and {2, 3}, each with its own tokens:
    a layer's loads are its own group's, and the flags are decided per group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    params = psf.shard_experts(full, mine)
    g = torch.Generator().manual_seed(100 + rank)        # every rank its own tokens
    x = torch.randn(T, H, generator=g, dtype=torch.float64) * (1 + rank)
    step = psf.stash_aware(_ep_loss(mine), psf.StashConfig(capacity_factor=4.0))
    res = psf.run_step(step, params, {"x": x}, step.init(params, {"x": x}))
    ids, _ = psf.route(full["router"], x, K)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    every = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(every, counts)
    group_counts = (every[2 * (rank // 2)] + every[2 * (rank // 2) + 1]).tolist()
    return list(res.report.layers[0].expert_load), group_counts, res.report.reran


def test_subgroup_loads_are_each_groups_own():
    values = spawn_world(4, [subgroup_loads])["subgroup_loads"]
    no_failures(values)
    for load, expected, reran in values:
        assert load == expected and not reran
    assert values[0][0] == values[1][0] and values[2][0] == values[3][0]
    assert values[0][0] != values[2][0]


LONE = """
import datetime, os, sys, torch, torch.distributed as dist
import pagedstash_func as psf
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2,
                        timeout=datetime.timedelta(seconds=20))
if dist.get_rank() == 0:            # an evaluation step on rank 0 alone
    g = torch.Generator().manual_seed(0)
    params = psf.moe_init(8, 16, 24, generator=g)
    batch = {"x": torch.randn(32, 16, generator=g)}
    def loss(p, b):
        return psf.moe(p, b["x"], top_k=2).pow(2).mean()
    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=1.25, expert_ranks=2))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    print("done", float(res.loss), flush=True)
dist.barrier()
"""


def test_a_lone_ranks_step_returns_without_waiting_for_the_others(tmp_path):
    script = tmp_path / "lone.py"
    script.write_text(textwrap.dedent(LONE))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    assert outs[0][0].startswith("done")


def ep_file_on_the_wrong_rank(rank, world):
    import tempfile
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    params = psf.shard_experts(full, dist.group.WORLD)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    step = psf.stash_aware(_ep_loss(dist.group.WORLD), psf.StashConfig(capacity_factor=2.0))
    folder = os.environ.get("PSF_TEST_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"ep_rank{rank}_{os.environ['MASTER_PORT']}.pt")
    psf.save_step(path, step, params, {"x": x}, step.init(params, {"x": x}))
    dist.barrier()
    other = os.path.join(folder, f"ep_rank{1 - rank}_{os.environ['MASTER_PORT']}.pt")
    try:
        psf.load_step(other, _ep_loss(dist.group.WORLD))
        refused = ""
    except ValueError as err:
        refused = str(err)
    own = psf.replay_step(path, _ep_loss(dist.group.WORLD))
    dist.barrier()
    os.remove(path)
    return "rank {} 's file".replace(" '", "'").format(1 - rank) in refused, bool(
        torch.isfinite(own.loss))


def test_an_expert_parallel_step_file_replays_only_on_its_own_rank():
    values = spawn_world(2, [ep_file_on_the_wrong_rank])["ep_file_on_the_wrong_rank"]
    no_failures(values)
    assert values == [(True, True), (True, True)]


def _mismatch(rank, world, what):
    full = psf.moe_init(E, H if not (what == "hidden" and rank) else H + 8, F,
                        generator=torch.Generator().manual_seed(0),
                        dtype=torch.float32 if (what == "dtype" and rank) else torch.float64)
    params = psf.shard_experts(full, dist.group.WORLD)
    x = torch.randn(T, full["router"].shape[1], dtype=full["router"].dtype)
    errors = []
    for call in ("exact", "init"):
        try:
            if call == "exact":
                psf.moe(params, x, top_k=K, group=dist.group.WORLD)
            else:
                step = psf.stash_aware(_ep_loss(dist.group.WORLD),
                                       psf.StashConfig(capacity_factor=1.5))
                step.init(params, {"x": x})
            errors.append("")
        except ValueError as err:
            errors.append(str(err))
    return errors


def mismatched_dtype(rank, world):
    return _mismatch(rank, world, "dtype")


def mismatched_hidden(rank, world):
    return _mismatch(rank, world, "hidden")


def test_ranks_that_disagree_on_dtype_or_hidden_size_all_raise_one_value_error():
    values = spawn_world(2, [mismatched_dtype, mismatched_hidden])
    for name, field in (("mismatched_dtype", "expert dtype"), ("mismatched_hidden", "hidden")):
        no_failures(values[name])
        for errors in values[name]:          # every rank, outside a step and at step.init
            assert all(f"disagree on its {field}" in e for e in errors), errors


def two_groups(rank, world):
    """Layers on two group objects over the same ranks are one set of ranks: run_step reads
    the flags over it without being told; group= is taken too."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    pa, pb = psf.shard_experts(full, a), psf.shard_experts(full, b)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)

    def loss(params, batch):
        h = psf.moe(params[0], batch["x"], top_k=K, group=a)
        return psf.moe(params[1], h, top_k=K, group=b).pow(2).mean()

    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=2.0))
    state = step.init([pa, pb], {"x": x})
    try:
        psf.run_step(step, [pa, pb], {"x": x}, state)
        refused = ""
    except ValueError as err:
        refused = str(err)
    res = psf.run_step(step, [pa, pb], {"x": x}, step.init([pa, pb], {"x": x}),
                       group=dist.group.WORLD)
    return refused, bool(torch.isfinite(res.loss))


def test_layers_on_groups_over_the_same_ranks_decide_together():
    values = spawn_world(2, [two_groups])["two_groups"]
    no_failures(values)
    assert values == [("", True), ("", True)]


def layers_on_different_groups(rank, world):
    """Layer a over the pairs {0, 1} and {2, 3} (each pair its own expert width), layer b over
    all four: step.init agrees each group on its own layers only, so the pairs' widths need
    not match, and run_step over the world equals the exact gradients."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    ffn = F if rank < 2 else F + 8
    full_a = psf.moe_init(E, H, ffn, generator=torch.Generator().manual_seed(rank // 2),
                          dtype=torch.float64)
    full_b = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64)
    params = [psf.shard_experts(full_a, mine), psf.shard_experts(full_b, dist.group.WORLD)]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)

    def loss(p, batch):
        h = psf.moe(p[0], batch["x"], top_k=K, group=mine)
        return psf.moe(p[1], h, top_k=K, group=dist.group.WORLD).pow(2).mean()

    import tempfile
    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=1.0))
    state = step.init(params, {"x": x})
    folder = os.environ.get("PSF_TEST_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"groups_rank{rank}_{os.environ['MASTER_PORT']}.pt")
    psf.save_step(path, step, params, {"x": x}, state, check_loss_fn=False)
    res = psf.run_step(step, params, {"x": x}, state, group=dist.group.WORLD)
    exact = torch.func.grad(loss)(params, {"x": x})
    same = all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in
               zip(torch.utils._pytree.tree_leaves(res.grads),
                   torch.utils._pytree.tree_leaves(exact)))
    try:
        psf.replay_step(path, loss, check_loss_fn=False)
        refused = False
    except ValueError as err:
        refused = "group=" in str(err)
    again = psf.replay_step(path, loss, check_loss_fn=False, group=dist.group.WORLD)
    os.remove(path)
    bits = torch.equal(again.loss, res.loss) and all(
        torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(again.grads),
                                          torch.utils._pytree.tree_leaves(res.grads)))
    return same, refused, bits, [layer.group_size for layer in res.report.layers]


def test_each_group_agrees_on_its_own_layers_at_init():
    values = spawn_world(4, [layers_on_different_groups])["layers_on_different_groups"]
    no_failures(values)
    assert values == [(True, True, True, [2, 4])] * 4
