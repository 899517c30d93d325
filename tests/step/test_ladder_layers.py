"""A rung per layer (`Ladder(per_layer=True)`): its decisions against hand-written reports,
the same as the one-rung ladder for one layer, a drifting two-layer run that gives each
layer its own rung with exact gradients, resumption from a file, and equal moves across
the ranks of an expert-parallel group."""

import math
import random

import pytest
import torch
import torch.distributed as dist
from ladder_runs import saved_and_resumed
from worlds import no_failures, spawn_world

import pagedstash_func as psf
from moe_reference import two_rank_ids, two_rank_report

E, H, F, K, T = 8, 16, 24, 2, 256
RUNGS = (1.0, 1.25, 1.5, 2.0)


def _report(ratios, over=False):
    """A report whose layer ``i``'s busier of two ranks carries ``ratios[i]`` (in [1, 2])
    times the balanced load."""
    return two_rank_report(ratios, T * K, over)


def test_decisions_against_a_hand_written_sequence():
    ladder = psf.Ladder(rungs=RUNGS, target_rerun_rate=0.1, window=10, per_layer=True)
    rungs, hist, since = (3, 3), (), 0
    for i in range(10):                 # layer 0 needs 1.1, layer 1 1.0: down after 10 steps
        nxt, hist, move = ladder.decide_layers(rungs, hist, _report((1.1, 1.0)), since)
        assert nxt == ((1, 0) if i == 9 else (3, 3)), (i, nxt)
        since = 0 if nxt != rungs else since + 1
        rungs = nxt
    assert move.why == "the rungs would have fit 10 of the last 10 steps"
    assert move.needed == (1.1015625, 1.0)        # 282 of the balanced 256 rows
    # over budget in layer 0 only: it climbs to the rung that fits, layer 1 stays
    nxt, hist, move = ladder.decide_layers((1, 0), hist, _report((1.3, 1.0), True), 0)
    assert nxt == (2, 0) and "climb layers [0]" in move.why
    # a flag with no layer over its rung here: another rank's; at the top rung: stay
    assert ladder.decide_layers((2, 0), hist, _report((1.0, 1.0), True))[0] == (2, 0)
    short = psf.Ladder(rungs=(1.0, 1.25, 1.5), per_layer=True)
    nxt, _, move = short.decide_layers((2, 0), (), _report((1.8, 1.0), True))
    assert nxt == (2, 0) and move.why == "over budget at the top rung: stay"
    with pytest.raises(ValueError, match="one index per layer"):
        ladder.decide_layers(3, (), _report((1.0,)))
    with pytest.raises(ValueError, match="ran 1 MoE layers where"):
        ladder.decide_layers((3, 3), (), _report((1.0,)))


def test_the_steps_that_would_rerun_are_counted_once_over_the_layers():
    """One step of ten may rerun: layer 0 takes it (1.0 misses step 0 only), so layer 1,
    which would miss step 5 at 1.0, must fit every other step: 1.25."""
    ladder = psf.Ladder(rungs=RUNGS, target_rerun_rate=0.1, window=10, per_layer=True)
    hist = tuple((1.2 if s == 0 else 1.0, 1.2 if s == 5 else 1.0) for s in range(9))
    nxt, _, move = ladder.decide_layers((3, 3), hist, _report((1.0, 1.0)), since_move=10)
    assert nxt == (0, 1) and move.why == "the rungs would have fit 9 of the last 10 steps"


def test_one_layer_decides_as_the_one_rung_ladder():
    rng = random.Random(0)
    one = psf.Ladder(rungs=RUNGS, target_rerun_rate=0.1, window=10)
    per = psf.Ladder(rungs=RUNGS, target_rerun_rate=0.1, window=10, per_layer=True)
    r, rs, h, hs, since = 3, (3,), (), (), 0
    for _ in range(300):
        ratio = rng.uniform(1.0, 2.0)
        over = ratio > RUNGS[r]
        nxt, h, move = one.decide(r, h, _report((ratio,), over), since)
        nxts, hs, moves = per.decide_layers(rs, hs, _report((ratio,), over), since)
        assert nxts == (nxt,) and moves.needed == (move.needed,)
        since = 0 if nxt != r else since + 1
        r, rs = nxt, nxts


def _batch(step, seed=0):
    """Two layers' routing: ``ids0`` skewed (from about 1.9x the balanced load, decaying to
    about 1.3x), ``ids1`` even."""
    g = torch.Generator().manual_seed(seed * 10_007 + step)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    return {"x": x, "ids0": two_rank_ids(T, E, 0.65 + 0.3 * math.exp(-step / 30), g),
            "ids1": two_rank_ids(T, E, 0.5, g)}


def _loss(params, batch):
    w = torch.full((T, K), 0.5, dtype=torch.float64)
    h = psf.moe(params["a"], batch["x"], top_k=K, routing=(batch["ids0"], w))
    return psf.moe(params["b"], h, top_k=K, routing=(batch["ids1"], w)).square().mean()


def _params():
    g = torch.Generator().manual_seed(0)
    return {n: psf.moe_init(E, H, F, generator=g, dtype=torch.float64) for n in "ab"}


CFG = psf.StashConfig(capacity_factor=1.0, expert_ranks=2, paged_stash=True, page_size=8,
                      pool_scope="layer")
LADDER = dict(rungs=(1.0, 1.1, 1.25, 1.5, 1.75, 2.0), target_rerun_rate=0.05, window=20)


def test_a_drifting_run_gives_each_layer_its_own_rung_and_stays_exact():
    params = _params()
    runs = {}
    for per_layer in (False, True):
        astep = psf.adaptive(_loss, CFG, psf.Ladder(**LADDER, per_layer=per_layer))
        astate = astep.init(params, _batch(0))
        reruns, budgets, profile = 0, [], psf.RoutingProfile()
        for i in range(80):
            batch = _batch(i)
            factor = astep.factor(astate)
            res, astate = astep(params, batch, astate)
            profile.add(res.report, astate.moves[-1], factor)
            reruns += res.report.reran
            budgets.append(sum(lay.budget for lay in res.report.layers))
            if i % 20 == 0 or res.report.reran:
                grads, loss = psf.value_and_grad(_loss)(params, batch)
                torch.testing.assert_close(res.loss, loss, rtol=1e-13, atol=0)
                for k in grads:
                    for n in grads[k]:
                        torch.testing.assert_close(res.grads[k][n], grads[k][n], rtol=1e-12,
                                                   atol=1e-14)
        climbs = sum(m.next_rung != m.rung and m.why.startswith("over") for m in astate.moves)
        assert reruns <= climbs + math.ceil(0.05 * 80)
        runs[per_layer] = (astate, sum(budgets) / len(budgets), profile)
    astate, mean_budget, profile = runs[True]
    last = astate.moves[-1].next_rung
    assert isinstance(last, tuple) and last[0] > last[1]     # the skewed layer sits higher
    assert mean_budget < runs[False][1]                      # the even one takes less
    assert "capacity factor: first (2.0, 2.0)" in profile.table()


def test_a_per_layer_run_saved_mid_way_resumes_with_the_same_moves(tmp_path):
    params = _params()
    ladder = psf.Ladder(**LADDER, per_layer=True)
    path = tmp_path / "step.pt"
    astate, loaded, resumed, _, _ = saved_and_resumed(
        lambda: psf.adaptive(_loss, CFG, ladder), _loss, params, _batch, 30, 45, path)
    assert loaded.moves == astate.moves[:30] and isinstance(loaded.rung, tuple)
    assert resumed.moves == astate.moves
    with pytest.raises(ValueError, match="per_layer=True"):
        psf.adaptive(_loss, CFG, psf.Ladder(**LADDER)).load(path, _loss, check_loss_fn=False)


def per_layer_ladder_on_two_ranks(rank, world):
    """Two expert-parallel layers over two ranks, skewed differently on each rank: the loads
    are summed over the group, so both ranks give each layer the same rung."""
    g = torch.Generator().manual_seed(0)
    params = {n: psf.shard_experts(psf.moe_init(E, H, F, generator=g, dtype=torch.float64),
                                   dist.group.WORLD) for n in "ab"}

    def loss(p, batch):
        h = psf.moe(p["a"], batch["x"], top_k=K, group=dist.group.WORLD)
        return psf.moe(p["b"], h, top_k=K, group=dist.group.WORLD).square().mean()

    astep = psf.adaptive(loss, psf.StashConfig(capacity_factor=1.0), psf.Ladder(
        rungs=(1.0, 1.5, 3.0), target_rerun_rate=0.1, window=5, start=0, per_layer=True))
    g = torch.Generator().manual_seed(rank)
    batch = {"x": torch.randn(T, H, generator=g, dtype=torch.float64) * (1 + 3 * rank)}
    astate = astep.init(params, batch)
    for _ in range(6):
        _, astate = astep(params, batch, astate)
    return [(m.rung, m.next_rung, tuple(round(n, 6) for n in m.needed))
            for m in astate.moves]


def test_ranks_of_one_group_give_each_layer_the_same_rung():
    values = spawn_world(2, [per_layer_ladder_on_two_ranks])
    no_failures(values["per_layer_ladder_on_two_ranks"])
    first, second = values["per_layer_ladder_on_two_ranks"]
    assert first == second and any(m[0] != m[1] for m in first)
