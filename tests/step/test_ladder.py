"""The adaptive capacity ladder: its decisions against hand-written reports, a drifting run
that holds its rerun budget with exact gradients, and equal decisions across ranks."""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from ladder_runs import saved_and_resumed
from worlds import no_failures, spawn_world

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 64


def _report(ratio, over=False):
    """A one-layer report whose busiest of two ranks carries ``ratio`` times the balanced
    load (``T * k / 2`` each)."""
    half = T * K // 2
    hi = round(ratio * half)
    layer = psf.LayerReport("moe0", (hi, T * K - hi), (hi, T * K - hi), rows=T * K,
                            balanced_rows=T * K, budget=half, capacity=T * K)
    return psf.StepReport(over, over, False, False, (layer,), {}, {}, 0, 0)


def _drive(ladder, rung, hist, since, steps):
    """Thread ``decide`` over ``steps`` (``(ratio, over)`` pairs) as `AdaptiveStep` does;
    returns the rungs after each step and the final ``(rung, hist, since, move)``."""
    rungs = []
    for ratio, over in steps:
        nxt, hist, move = ladder.decide(rung, hist, _report(ratio, over), since)
        since = 0 if nxt != rung else since + 1
        rung = nxt
        rungs.append(rung)
    return rungs, (rung, hist, since, move)


def test_decisions_against_a_hand_written_sequence():
    ladder = psf.Ladder(rungs=(1.0, 1.25, 1.5, 2.0), target_rerun_rate=0.1, window=10)
    assert ladder.calm_steps == 5
    # ten steps needing 1.1: after the tenth (enough evidence) straight down to 1.25
    rungs, (rung, hist, since, move) = _drive(ladder, 3, (), 0, [(1.1, False)] * 10)
    assert rungs == [3] * 9 + [1] and "fit 10 of the last 10" in move.why
    # four calm steps, then one over budget needing 1.7: climb to the rung that fits it
    rungs, (rung, hist, since, move) = _drive(ladder, rung, hist, since,
                                              [(1.1, False)] * 4 + [(1.7, True)])
    assert rungs == [1] * 4 + [3] and move.needed == pytest.approx(1.7, abs=0.02)
    # a cooldown of five steps, then down: 1 of the last 10 may need more (floor(0.1 * 10))
    rungs, (rung, hist, since, move) = _drive(ladder, rung, hist, since, [(1.1, False)] * 5)
    assert rungs == [3] * 4 + [1] and "fit 9 of the last 10" in move.why
    # two of the last ten need the top rung: it stays there until one leaves the window
    rungs, (rung, hist, since, move) = _drive(ladder, rung, hist, since,
                                              [(1.6, True), (1.6, False)] + [(1.1, False)] * 9)
    assert rungs == [3] * 10 + [1]       # the last step leaves one 1.6 in the window
    assert "fit 9 of the last 10" in move.why
    # nothing is decided on fewer than MIN_EVIDENCE steps, or a whole window if shorter
    rungs, _ = _drive(ladder, 3, (), 0, [(1.0, False)] * 9)
    assert rungs == [3] * 9
    short = psf.Ladder(rungs=(1.0, 1.25, 1.5, 2.0), target_rerun_rate=0.1, window=6)
    rungs, _ = _drive(short, 3, (), 0, [(1.0, False)] * 6)
    assert rungs == [3] * 5 + [0]
    rung, hist, move = ladder.decide(0, (), _report(9.0, over=True))     # beyond the top
    assert rung == 3
    with pytest.raises(ValueError, match="another ladder"):
        ladder.decide(7, (), _report(1.0))


def test_the_descent_rung_is_the_lowest_that_fits_all_but_the_allowed_share():
    """quantile_rung against its definition, counted by hand on random histories."""
    import random
    ladder = psf.Ladder(rungs=(1.0, 1.05, 1.1, 1.2, 1.5, 2.0), target_rerun_rate=0.1)
    rng = random.Random(0)
    for _ in range(500):
        history = tuple(rng.uniform(0.5, 2.5) for _ in range(rng.randint(1, 30)))
        allowed = math.floor(0.1 * len(history))
        want = next((i for i, r in enumerate(ladder.rungs)
                     if sum(h > r for h in history) <= allowed), len(ladder.rungs) - 1)
        assert ladder.quantile_rung(history) == want


def _decide_by_definition(ladder, rung, history, need, over, since):
    """The rule of `psf.Ladder`'s docstring, written out plainly (a window sorted and
    counted every step, rungs searched one by one): the reference for `decide`."""
    rungs, top = ladder.rungs, len(ladder.rungs) - 1
    history = (tuple(history) + (need,))[-ladder.steps_seen:]
    lowest = lambda f: next((i for i, r in enumerate(rungs) if r >= f), top)
    if over:
        if need <= rungs[rung]:
            return rung, history
        return min(top, max(rung + 1, lowest(need))), history
    enough = len(history) >= min(10, ladder.steps_seen)
    if rung > 0 and enough and since + 1 >= ladder.calm_steps:
        allowed = math.floor(ladder.target_rerun_rate * len(history) + 1e-9)
        down = next(i for i in range(top + 1)
                    if i == top or sum(h > rungs[i] for h in history) <= allowed)
        if down < rung:
            return down, history
    return rung, history


def test_decide_prepared_before_the_report_equals_the_rule_on_random_runs():
    """`Ladder.decide` (its window's order worked out in `prepare`, before the report comes)
    against the rule computed from scratch every step, over random runs of random ladders:
    the same rung, history and counts each step."""
    import random
    rng = random.Random(1)
    for _ in range(60):
        rungs = tuple(sorted(rng.sample([1.0, 1.05, 1.1, 1.2, 1.25, 1.3, 1.5, 1.75, 2.0, 3.0],
                                        rng.randint(1, 7))))
        ladder = psf.Ladder(rungs=rungs, target_rerun_rate=rng.choice([0.02, 0.1, 0.25, 0.5,
                                                                       1 - 1e-12]),
                            window=rng.choice([None, 1, 3, 10, 25]),
                            cooldown=rng.choice([None, 1, 4]))
        rung, hist, since = rng.randrange(len(rungs)), (), 0
        for _ in range(120):
            report = _report(rng.choice([rng.uniform(0.5, 3.5), rng.choice(rungs)]))
            need = max(report.layers[0].rank_load) / (T * K // 2)   # ties at rungs too
            over = need > rungs[rung] or rng.random() < 0.05     # or another rank's flag
            report = dataclasses.replace(report, over_budget=over)
            want_rung, want_hist = _decide_by_definition(ladder, rung, hist, need, over, since)
            got, hist, move = ladder.decide(rung, hist, report, since)
            assert (got, hist) == (want_rung, want_hist), (ladder, rung, need, over, since)
            assert move.needed == need and (move.rung, move.next_rung) == (rung, got)
            if got < rung:
                count = sum(h <= rungs[got] for h in hist)
                assert f"fit {count} of the last {len(hist)}" in move.why
            since = 0 if got != rung else since + 1
            rung = got


def test_bad_ladders_and_configs_name_the_fix():
    for kw, word in [(dict(rungs=(1.5, 1.25)), "increasing"), (dict(rungs=()), "increasing"),
                     (dict(target_rerun_rate=0), "target_rerun_rate"),
                     (dict(start=9), "start"), (dict(window=0), "window"),
                     (dict(cooldown=0), "cooldown")]:
        with pytest.raises(ValueError, match=word):
            psf.Ladder(**kw)
    with pytest.raises(ValueError, match="pool_scope='layer'"):
        psf.adaptive(lambda p, b: 0, psf.StashConfig(capacity_factor=1.0, paged_stash=True))


def _drifting_batch(step, seed=0):
    """Routing whose skew decays over the steps: early steps send most pairs to the first
    rank's experts, late ones spread them evenly."""
    g = torch.Generator().manual_seed(seed * 10_007 + step)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    skew = 0.9 * math.exp(-step / 15)
    first = torch.rand(T, generator=g) < 0.5 + skew / 2
    base = torch.where(first, torch.randint(0, E // 2, (T,), generator=g),
                       torch.randint(E // 2, E, (T,), generator=g))
    ids = torch.stack([base, (base + 1) % (E // 2) + (base // (E // 2)) * (E // 2)], 1)
    return {"x": x, "ids": ids}


def _loss(params, batch):
    w = torch.full(batch["ids"].shape, 0.5, dtype=torch.float64)
    return psf.moe(params, batch["x"], top_k=K, routing=(batch["ids"], w)).square().mean()


def test_a_drifting_run_descends_keeps_its_rerun_budget_and_stays_exact():
    """60 steps, skew decaying from 1.9x to about 1.1x the balanced load: the ladder starts
    at the top, comes down as the skew fades, and reruns only where it climbs (each climb is
    one rerun; the budget is the target share of the steps plus the climbs)."""
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    ladder = psf.Ladder(rungs=(1.0, 1.1, 1.25, 1.5, 2.0), target_rerun_rate=0.05, window=10)
    astep = psf.adaptive(_loss, psf.StashConfig(capacity_factor=1.0, expert_ranks=2,
                                                paged_stash=True, page_size=8,
                                                pool_scope="layer"), ladder)
    astate = astep.init(params, _drifting_batch(0))
    reruns, factors = 0, []
    profile = psf.RoutingProfile()
    for i in range(60):
        batch = _drifting_batch(i)
        factors.append(astep.factor(astate))
        res, astate = astep(params, batch, astate)
        profile.add(res.report, astate.moves[-1], factors[-1])
        reruns += res.report.reran
        if i % 20 == 0:
            ref = torch.func.grad(_loss)(params, batch)
            assert all(torch.allclose(res.grads[k], ref[k], rtol=1e-12, atol=1e-13)
                       for k in ref)
    climbs = sum(m.next_rung > m.rung for m in astate.moves)
    assert reruns <= climbs + math.ceil(0.05 * 60)
    assert factors[0] == 2.0 and factors[-1] < 1.5       # came down as the skew faded
    assert len(astate.moves) == 60
    assert [s["factor"] for s in profile.steps] == factors
    assert [s["reran"] for s in profile.steps] == [bool(m.rerun) for m in astate.moves]
    moved = sum(m.rung != m.next_rung for m in astate.moves)
    assert f"first 2.0, last {factors[-1]}" in profile.table() and f"{moved} moves" in \
        profile.table()
    # the rungs it left hold one set of zeroed flags and counts between them, not one each
    resting = [s for r, s in astate.states.items() if r != astate.rung]
    assert len(resting) >= 2
    assert all(s.flags is resting[0].flags and
               all(s.counts[k] is resting[0].counts[k] for k in s.counts) and
               not s.flags.any() and not any(c.any() for c in s.counts.values())
               for s in resting)
    current = astate.states[astate.rung]
    assert current.flags is not resting[0].flags and not current.flags.any()
    again = astep.init(params, _drifting_batch(0))        # the same run: the same moves
    for i in range(60):
        _, again = astep(params, _drifting_batch(i), again)
    assert again.moves == astate.moves


def test_a_step_over_budget_reruns_at_the_rung_that_fits_or_exactly():
    """Over budget at cf 1.0: the step reruns as a capacity attempt at the lowest rung that
    fits what it needed (no drops: its loss and gradients equal the exact path's to fp64
    rounding), or, when no rung fits, on the exact path (the exact path's own bits)."""
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    batch = _drifting_batch(0)                        # about 1.9x the balanced load
    cfg = psf.StashConfig(capacity_factor=1.0, expert_ranks=2, paged_stash=True, page_size=8,
                          pool_scope="layer")
    exact = psf.value_and_grad(_loss)(params, batch)
    for rungs, rerun in [((1.0, 1.25, 2.0, 4.0), "cf 2.0"), ((1.0, 1.5), "exact")]:
        astep = psf.adaptive(_loss, cfg, psf.Ladder(rungs=rungs, start=0))
        res, astate = astep(params, batch, astep.init(params, batch))
        move = astate.moves[-1]
        assert res.report.reran and res.report.over_budget and move.rerun == rerun
        assert move.needed > 1.5 and move.next_rung == (2 if rerun != "exact" else 1)
        if rerun == "exact":
            assert torch.equal(res.loss, exact[1])
            assert all(torch.equal(res.grads[k], exact[0][k]) for k in exact[0])
        else:
            torch.testing.assert_close(res.loss, exact[1], rtol=1e-13, atol=0)
            for k in exact[0]:
                torch.testing.assert_close(res.grads[k], exact[0][k], rtol=1e-12, atol=1e-14)
        again, astate = astep(params, batch, astate)    # at the rung it climbed to
        assert again.report.reran == (rerun == "exact") and astate.moves[-1].rerun == \
            ("exact" if rerun == "exact" else "")
        torch.testing.assert_close(again.loss, exact[1], rtol=1e-13, atol=0)
    fp8 = psf.StashConfig(capacity_factor=1.0, expert_ranks=2, paged_stash=True, page_size=8,
                          pool_scope="layer", stash_precision="fp8")
    astep = psf.adaptive(_loss, fp8, psf.Ladder(rungs=(1.0, 2.0, 4.0), start=0))
    res, astate = astep(params, batch, astep.init(params, batch))    # a lossy stash: exact
    assert astate.moves[-1].rerun == "exact" and torch.equal(res.loss, exact[1])
    assert all(torch.equal(res.grads[k], exact[0][k]) for k in exact[0])


def ladder_on_two_ranks(rank, world):
    """An expert-parallel group of two ranks, one skewed and one even: the reports are summed
    over the group, so both ranks make the same moves."""
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    params = psf.shard_experts(full, dist.group.WORLD)

    def loss(p, batch):
        return psf.moe(p, batch["x"], top_k=K, group=dist.group.WORLD).square().mean()

    astep = psf.adaptive(loss, psf.StashConfig(capacity_factor=1.0), psf.Ladder(
        rungs=(1.0, 1.5, 3.0), target_rerun_rate=0.1, window=5, start=0))
    g = torch.Generator().manual_seed(rank)
    batch = {"x": torch.randn(T, H, generator=g, dtype=torch.float64) * (1 + 3 * rank)}
    astate = astep.init(params, batch)
    for _ in range(6):
        _, astate = astep(params, batch, astate)
    return [(m.rung, m.next_rung, round(m.needed, 6)) for m in astate.moves]


def mixed_layers_are_refused(rank, world):
    """An expert-parallel layer beside a layer of one rank's own: each rank would decide from
    its own local loads; refused on every rank alike."""
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    params = {"ep": psf.shard_experts(full, dist.group.WORLD),
              "local": psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(1),
                                    dtype=torch.float64)}

    def loss(p, batch):
        y = psf.moe(p["ep"], batch["x"], top_k=K, group=dist.group.WORLD)
        return psf.moe(p["local"], y, top_k=K).square().mean()

    batch = {"x": torch.randn(T, H, generator=torch.Generator().manual_seed(rank),
                              dtype=torch.float64)}
    astep = psf.adaptive(loss, psf.StashConfig(capacity_factor=1.0, expert_ranks=2),
                         psf.Ladder(rungs=(1.0, 2.0), start=0))
    try:
        astep(params, batch, astep.init(params, batch))
    except ValueError as err:
        return str(err)
    return "not refused"


def test_ranks_of_one_group_make_the_same_moves():
    values = spawn_world(2, [ladder_on_two_ranks, mixed_layers_are_refused])
    no_failures(values["ladder_on_two_ranks"])
    assert values["ladder_on_two_ranks"][0] == values["ladder_on_two_ranks"][1]
    assert all("expert-parallel layers beside layers of one rank's own" in v
               for v in values["mixed_layers_are_refused"]), values


def two_groups_under_one_flag_group(rank, world):
    """Four ranks, expert-parallel groups {0, 1} (skewed) and {2, 3} (even), the flags read
    over every rank (a loss that reduces over all four): the groups' reports differ, so a
    flagged step reruns on the exact path on every rank (none waits on another's rerun), and
    each group moves on its own loads."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    params = psf.shard_experts(full, mine)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    even = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)
    skew = torch.stack([torch.arange(T) % 4, (torch.arange(T) + 1) % 4], 1)
    w = torch.full((T, K), 0.5, dtype=torch.float64)
    batch = {"x": x, "ids": skew if rank < 2 else even}

    def loss(p, b):
        return psf.moe(p, b["x"], top_k=K, routing=(b["ids"], w), group=mine).square().mean()

    astep = psf.adaptive(loss, psf.StashConfig(capacity_factor=1.0),
                         psf.Ladder(rungs=(1.0, 1.5, 2.0), start=0))
    astate = astep.warm(params, batch, astep.init(params, batch))
    out = []
    for _ in range(2):
        res, astate = astep(params, batch, astate, group=dist.group.WORLD)
        ref = torch.func.grad(loss)(params, batch)
        exact = all(torch.allclose(res.grads[k], ref[k], rtol=1e-12, atol=1e-14) for k in ref)
        m = astate.moves[-1]
        out.append((m.rung, m.next_rung, m.rerun, exact))
    return out


def test_expert_parallel_groups_under_one_wider_flag_group_rerun_exactly():
    values = spawn_world(4, [two_groups_under_one_flag_group])
    runs = values["two_groups_under_one_flag_group"]
    no_failures(runs)
    assert runs[0] == runs[1] and runs[2] == runs[3]
    assert runs[0][0] == (0, 2, "exact", True) and runs[2][0] == (0, 0, "exact", True)
    assert all(step[3] for run in runs for step in run)


def test_an_adaptive_run_saved_mid_way_resumes_with_the_same_moves_and_bits(tmp_path):
    """AdaptiveStep.save_step at step 12, then load: the 12 steps after it make the same moves
    and give the same bits as the uninterrupted run; a file of another ladder is refused."""
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    ladder = psf.Ladder(rungs=(1.0, 1.1, 1.25, 1.5, 2.0), target_rerun_rate=0.05, window=10)
    cfg = psf.StashConfig(capacity_factor=1.0, expert_ranks=2, paged_stash=True, page_size=8,
                          pool_scope="layer")
    path = tmp_path / "step.pt"
    astate, loaded, resumed, b2, tail = saved_and_resumed(
        lambda: psf.adaptive(_loss, cfg, ladder), _loss, params, _drifting_batch, 12, 24, path)
    assert loaded.moves == astate.moves[:12] and torch.equal(b2["x"], _drifting_batch(12)["x"])
    assert resumed.moves == astate.moves
    replayed, after = psf.adaptive(_loss, cfg, ladder).replay(path, _loss, check_loss_fn=False)
    assert torch.equal(replayed.loss, tail[0]) and after.moves == astate.moves[:13]
    with pytest.raises(ValueError, match="another|this ladder"):
        psf.adaptive(_loss, cfg, psf.Ladder(rungs=(1.0, 2.0))).load(path, _loss,
                                                                   check_loss_fn=False)
    assert psf.load_policy(path)["rung"] == resumed.moves[11].next_rung
    with pytest.raises(ValueError, match="saved by a ladder with {'target_rerun_rate'"):
        psf.adaptive(_loss, cfg, psf.Ladder(rungs=ladder.rungs, target_rerun_rate=0.1,
                                            window=10)).load(path, _loss, check_loss_fn=False)


def test_misused_adaptive_states_are_refused_before_the_step_runs():
    """A state of another adaptive step, a used state, another batch shape, a loss without
    MoE layers under a per-layer ladder: each a clear error, the states left usable."""
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    cfg = psf.StashConfig(capacity_factor=1.0, expert_ranks=2, paged_stash=True, page_size=8,
                          pool_scope="layer")
    rungs = (1.0, 1.5, 2.0)
    one = psf.adaptive(_loss, cfg, psf.Ladder(rungs=rungs))
    each = psf.adaptive(_loss, cfg, psf.Ladder(rungs=rungs, per_layer=True))
    batch = _drifting_batch(0)
    a1, a2 = one.init(params, batch), each.init(params, batch)
    for step, wrong in ((one, a2), (each, a1)):
        for call in (lambda: step(params, batch, wrong), lambda: step.warm(params, batch, wrong)):
            with pytest.raises(ValueError, match="another adaptive step"):
                call()
    other = psf.adaptive(_loss, dataclasses.replace(cfg, page_size=16), psf.Ladder(rungs=rungs))
    with pytest.raises(ValueError, match="another adaptive step"):   # same rungs, other config
        other(params, batch, a1)
    a3 = each.init(params, batch)
    with pytest.raises(ValueError, match="a rung for 2 MoE layers where its states have 1"):
        each(params, batch, dataclasses.replace(a3, rung=(2, 2)))
    res1, b1 = one(params, batch, a1)            # no state was touched by the refusals
    res2, b2 = each(params, batch, a2)
    assert torch.equal(res1.loss, res2.loss) and torch.equal(each(params, batch, a3)[0].loss,
                                                             res1.loss)
    with pytest.raises(psf.ConsumedStateError, match="already used by an earlier call"):
        one(params, batch, a1)
    short = {k: v[: T // 2] for k, v in batch.items()}
    with pytest.raises(psf.StateMismatchError, match="AdaptiveState per shape"):
        one(params, short, b1)
    assert torch.equal(one(params, batch, b1)[0].loss, res1.loss)   # b1 is left usable
    _, _ = one(params, short, one.init(params, short))       # its own state: fine
    # a rung not visited yet: its state would be built for the short batch, beside the others
    moved = dataclasses.replace(one.init(params, batch), rung=0)
    with pytest.raises(psf.StateMismatchError, match="AdaptiveState per shape"):
        one(params, short, moved)
    _, after = one(params, batch, moved)
    with pytest.raises(psf.ConsumedStateError, match="already used"):   # its rung had no state
        one(params, batch, moved)
    with pytest.raises(ValueError, match="calls psf.moe nowhere"):
        psf.adaptive(lambda p, b: b["x"].sum(), cfg, psf.Ladder(per_layer=True)).init(
            params, batch)
    with pytest.raises(ValueError, match="another ladder"):
        psf.Ladder(rungs=rungs).decide(True, (), _report(1.0))      # a bool is no rung index


def test_ladder_arithmetic_edges():
    import numpy as np
    assert psf.Ladder(rungs=np.array([1.0, 1.5], dtype=np.float32)).rungs == (1.0, 1.5)
    ladder = psf.Ladder(target_rerun_rate=0.29)
    assert ladder.allowed(100) == 29 and 0.29 * 100 < 29       # the float product floors to 28
    assert psf.Ladder(target_rerun_rate=0.57).allowed(100) == 57 and 0.57 * 100 < 57


def test_a_run_keeps_bounded_history_and_moves_and_refuses_an_absurd_window(tmp_path,
                                                                          monkeypatch):
    """The window is at most MAX_WINDOW steps (a target whose window would be larger needs an
    explicit one); a state keeps the window's needs and the last MOVES_KEPT moves, counts its
    steps, and its step file keeps no more."""
    from pagedstash_func.step import _adaptive
    with pytest.raises(ValueError, match="window of 1e\\+09 steps.*at least 0.0001"):
        psf.Ladder(target_rerun_rate=1e-9)
    with pytest.raises(ValueError, match="window=20000\\) exceeds 10000"):
        psf.Ladder(window=20_000)
    with pytest.raises(ValueError, match="cooldown=20000\\) exceeds 10000"):
        psf.Ladder(cooldown=20_000)
    assert psf.Ladder(target_rerun_rate=1e-9, window=500).steps_seen == 500
    monkeypatch.setattr(_adaptive, "MOVES_KEPT", 5)
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    cfg = psf.StashConfig(capacity_factor=1.0, expert_ranks=2, paged_stash=True, page_size=8,
                          pool_scope="layer")
    astep = psf.adaptive(_loss, cfg, psf.Ladder(window=4))
    astate = astep.init(params, _drifting_batch(0))
    log = []
    for i in range(9):
        _, astate = astep(params, _drifting_batch(i), astate)
        log.append(astate.moves[-1])
    assert astate.steps == 9 and astate.moves == tuple(log[-5:])
    assert len(astate.history) == 4
    path = tmp_path / "step.pt"
    astep.save_step(path, params, _drifting_batch(9), astate, check_loss_fn=False)
    assert len(psf.load_policy(path)["moves"]) == 5
    _, _, resumed = psf.adaptive(_loss, cfg, psf.Ladder(window=4)).load(path, _loss,
                                                                        check_loss_fn=False)
    assert resumed.steps == 9 and resumed.moves == astate.moves
    assert psf.AdaptiveState(0, (), {}, log).moves == tuple(log[-5:])


def test_a_compiled_ladder_makes_the_eager_ladders_moves_with_its_numbers():
    """Three compiled rungs over a drifting run: one compile per rung used, no recompile
    after, and the moves, reruns and gradients of the eager ladder."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    ladder = psf.Ladder(rungs=(1.1, 1.5, 2.0), target_rerun_rate=0.2, window=5)
    cfg = psf.StashConfig(capacity_factor=1.0, expert_ranks=2, paged_stash=True, page_size=8,
                          pool_scope="layer")
    eager = psf.adaptive(_loss, cfg, ladder)
    compiled = psf.adaptive(_loss, cfg, ladder, compiled={"backend": "aot_eager"})
    a, b = compiled.init(params, _drifting_batch(0)), eager.init(params, _drifting_batch(0))
    graphs = counters["stats"]["unique_graphs"]
    for i in range(30):         # down, up again by a rerun, down again
        ra, a = compiled(params, _drifting_batch(i), a)
        rb, b = eager(params, _drifting_batch(i), b)
        assert ra.report.reran == rb.report.reran
        for k in rb.grads:
            torch.testing.assert_close(ra.grads[k], rb.grads[k], rtol=1e-10, atol=1e-12)
    assert a.moves == b.moves
    used = {m.rung for m in b.moves} | {m.next_rung for m in b.moves}
    assert len(used) >= 2 and any(m.rerun for m in b.moves)     # it moved and it reran
    assert counters["stats"]["unique_graphs"] - graphs <= len(ladder.rungs)
