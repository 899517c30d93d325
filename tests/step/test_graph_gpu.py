"""On CUDA only: a graphed step replays bit for bit like eager run_step, re-captures on a new
shape, reruns a flagged attempt eagerly, and syncs nowhere during replay."""

import pytest
import torch
import torch.utils._pytree as pytree
from sync_free import without_sync

import pagedstash_func as psf
from moe_reference import two_rank_ids
from pagedstash_func.cli import _demo as demo

pytestmark = pytest.mark.gpu


def setup(batch_size=32, seed=0, capacity_factor=1.25, host_factor=0.0, scope="state"):
    text = demo.corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    params = demo.init_model(len(vocab), hidden=128, ffn=256, experts=8, layers=3, seq=64,
                             seed=seed, device="cuda")
    cfg = psf.StashConfig(capacity_factor=capacity_factor, paged_stash=True, expert_ranks=2,
                          cuda_factor=0.3 if host_factor else 1.1, host_factor=host_factor,
                          pool_scope=scope)
    step = psf.stash_aware(demo.make_loss_fn(dtype=torch.bfloat16), cfg)

    def batch(i, size=batch_size):
        return {k: v.cuda() for k, v in demo.make_batch(data, i, batch_size=size, seq=64,
                                                        seed=seed).items()}
    return step, params, batch


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


@pytest.mark.parametrize("host_factor,scope", [(0.0, "state"), (1.0, "state"), (0.0, "layer")])
def test_replay_equals_eager_and_threads_state(host_factor, scope):
    torch.use_deterministic_algorithms(True)
    try:
        step, params, batch = setup(host_factor=host_factor, scope=scope)
        gstep = psf.graphed(step)
        g_state = step.init(params, batch(0))
        e_state = g_state.clone()
        for i in range(4):
            new_params = pytree.tree_map(lambda t: t * 0.999, params)   # new tensors each step
            consumed = g_state
            g = gstep(new_params, batch(i), g_state)
            e = psf.run_step(step, new_params, batch(i), e_state)
            assert same(g.grads, e.grads) and torch.equal(g.loss, e.loss), i
            assert g.report == e.report and g.report.host_spill == bool(host_factor)
            g_state, e_state, params = g.state, e.state, new_params
        with pytest.raises(psf.ConsumedStateError):
            gstep(params, batch(9), consumed)
    finally:
        torch.use_deterministic_algorithms(False)


def test_new_shape_recaptures_and_a_flagged_attempt_reruns():
    step, params, batch = setup(capacity_factor=0.6)        # tight: most steps rerun
    gstep = psf.graphed(step, max_graphs=2)
    state = step.init(params, batch(0))
    res = gstep(params, batch(0), state)
    exact = torch.func.grad(lambda p: step.exact(p, batch(0))[0])(params)
    assert res.report.reran and same(res.grads, exact)
    small = batch(1, size=16)                                # a new shape: a new graph
    res2 = gstep(params, small, step.init(params, small))
    exact2 = torch.func.grad(lambda p: step.exact(p, small)[0])(params)
    assert len(gstep._captures) == 2 and same(res2.grads, exact2)
    gstep.clear()
    assert not gstep._captures


@pytest.mark.parametrize("scope", ["state", "layer"])
def test_replay_does_not_sync(scope):
    step, params, batch = setup(scope=scope)
    gstep = psf.graphed(step)
    gstep(params, batch(0), step.init(params, batch(0)))
    capture = next(iter(gstep._captures.values()))
    without_sync(capture.graph.replay)
    torch.cuda.synchronize()
    assert torch.isfinite(capture.loss)


def test_params_and_state_are_donated_and_grads_can_come_without_a_copy():
    """The graph reads the caller's params and pools in place (nothing held twice); with
    copy_grads=False each replay hands out the graph's own gradient buffers."""
    step, params, batch = setup()
    gstep = psf.graphed(step, donate=True, copy_grads=False)
    state = step.init(params, batch(0))
    pools = [p.cuda for p in state.pools.values()]
    first = gstep(params, batch(0), state)
    cap = next(iter(gstep._captures.values()))
    assert all(a is b for a, b in zip(pytree.tree_leaves(cap.params), pytree.tree_leaves(params)))
    assert all(a is b for a, b in zip([p.cuda for p in cap.state.pools.values()], pools))
    ptrs = [g.data_ptr() for g in pytree.tree_leaves(first.grads)]
    eager = psf.run_step(step, params, batch(1), first.state.clone())
    second = gstep(params, batch(1), first.state)
    assert [g.data_ptr() for g in pytree.tree_leaves(second.grads)] == ptrs
    assert same(second.grads, eager.grads) and torch.equal(second.loss, eager.loss)
    copying = psf.graphed(step, donate=False)
    third = copying(params, batch(2), step.init(params, batch(2)))
    cap = next(iter(copying._captures.values()))
    assert not any(a is b for a, b in zip(pytree.tree_leaves(cap.params),
                                          pytree.tree_leaves(params)))
    assert torch.isfinite(third.loss)
    new = pytree.tree_map(torch.clone, params)              # other tensors: refused, untouched
    with pytest.raises(ValueError, match="not the tensor this graph was captured with"):
        gstep(new, batch(3), second.state)


@pytest.mark.parametrize("max_graphs,warm,copy_grads,per_layer", [
    (2, False, True, False), (None, True, True, False), (None, True, False, False),
    (None, True, True, True), (2, False, True, True)])
def test_an_adaptive_ladder_replayed_from_graphs_equals_eager(max_graphs, warm, copy_grads,
                                                             per_layer):
    """psf.adaptive(graph=True): each rung's attempt from a graph (two rungs' graphs kept, or
    all of them captured up front by warm), reruns at the rung that fits included: the same
    moves, losses and gradients as the eager ladder, bit for bit, whether the gradients come
    out as copies of memory the pool reuses or from buffers the graphs share, with one rung
    or (two layers) a rung per layer."""
    g = torch.Generator().manual_seed(3)
    params = {n: psf.moe_init(16, 128, 96, generator=g, dtype=torch.bfloat16, device="cuda")
              for n in ("a", "b")[:1 + per_layer]}

    def loss(p, batch):
        if not per_layer:
            return psf.moe(p["a"], batch["x"], top_k=2).float().square().mean()
        w = torch.full(batch["ids"].shape, 0.5, dtype=torch.bfloat16, device="cuda")
        h = psf.moe(p["a"], batch["x"], top_k=2, routing=(batch["ids"], w))   # skewed
        return psf.moe(p["b"], h, top_k=2).float().square().mean()            # routed

    ladder = psf.Ladder(rungs=(0.6, 1.0, 1.5, 2.5) if per_layer else (0.6, 1.0, 2.0),
                        target_rerun_rate=0.2, window=3, start=0, per_layer=per_layer)
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, expert_ranks=4,
                          pool_scope="layer")
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for graph in (False, True):
            astep = psf.adaptive(loss, cfg, ladder, graph=graph, max_graphs=max_graphs,
                                 copy_grads=copy_grads)
            xs = [{"x": torch.randn(256, 128, generator=torch.Generator().manual_seed(i)).to(
                       "cuda", torch.bfloat16) * (1 + (i % 3)),
                   "ids": two_rank_ids(256, 16, (0.5, 0.95, 0.7)[i % 3],
                                       torch.Generator().manual_seed(i)).cuda()}
                  for i in range(8)]
            astate = astep.init(params, xs[0])
            if warm:
                astate = astep.warm(params, xs[0], astate)
                assert astep.captures == (len(ladder.rungs) if graph else 0)
            out = []
            for x in xs:
                res, astate = astep(params, x, astate)
                out.append((res.loss.clone(), {(n, k): v.clone() for n, tree in
                                               res.grads.items() for k, v in tree.items()}))
            runs.append((out, astate.moves))
            if graph:
                assert len(astep._graphs) <= (max_graphs or len(ladder.rungs))
                if warm:
                    # none during the run; with a rung per layer, one per tuple of rungs
                    # that are not all alike
                    tuples = {m.next_rung for m in astate.moves} | {m.rung for m in astate.moves}
                    split = sum(1 for t in tuples if per_layer and len(set(t)) > 1)
                    assert astep.captures == len(ladder.rungs) + split if not per_layer \
                        else astep.captures >= len(ladder.rungs) + split
    finally:
        torch.use_deterministic_algorithms(False)
    (eager, moves_e), (graphed, moves_g) = runs
    assert moves_e == moves_g and any(m.rung != m.next_rung for m in moves_e)
    assert any(m.rerun.startswith("cf") for m in moves_e)
    if per_layer:                               # the layers took rungs of their own
        assert any(len(set(m.next_rung)) > 1 for m in moves_e)
    for (le, ge), (lg, gg) in zip(eager, graphed):
        assert torch.equal(le, lg) and all(torch.equal(ge[k], gg[k]) for k in ge)


def test_the_graphs_of_an_adaptive_ladder_share_one_pool():
    """Four rungs' graphs captured up front by an adaptive step reserve well under what four
    graphed steps of those rungs reserve apart: one memory pool, one set of static params,
    batch and gradient buffers; none is captured again during the run."""
    import dataclasses
    step, params, batch = setup(batch_size=128, scope="layer")
    loss_fn = demo.make_loss_fn(dtype=torch.bfloat16)
    rungs = (1.1, 1.25, 1.5, 2.0)

    def reserved():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    before = reserved()
    apart = []
    for r in rungs:
        rung = psf.stash_aware(loss_fn, dataclasses.replace(step.cfg, capacity_factor=r))
        apart.append(psf.graphed(rung))
        apart[-1].prepare(params, batch(0), rung.init(params, batch(0)))
    separate = reserved() - before
    del apart, rung
    before = reserved()
    astep = psf.adaptive(loss_fn, dataclasses.replace(step.cfg, capacity_factor=2.0),
                         psf.Ladder(rungs=rungs), graph=True)
    astate = astep.warm(params, batch(0), astep.init(params, batch(0)))
    shared = reserved() - before
    assert astep.captures == 4
    assert shared <= 0.6 * separate, (shared, separate)
    res, astate = astep(params, batch(1), astate)
    assert torch.isfinite(res.loss) and astep.captures == 4


def test_an_adaptive_ladders_peak_is_its_top_rungs():
    """Every rung's graph captured, in one pool, adds nothing to the peak over the top rung's
    graphed step alone: the rungs' gradients are copied out after their own replay, and their
    memory is left for the next capture to reuse. Peaks counted from before the states."""
    import dataclasses
    step, params, batch = setup(batch_size=128, scope="layer")
    loss_fn = demo.make_loss_fn(dtype=torch.bfloat16)
    rungs = (1.0, 1.1, 1.25, 1.5, 2.0)
    top = dataclasses.replace(step.cfg, capacity_factor=rungs[-1])

    def peak(run):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        losses = run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, losses

    def fixed():
        fstep = psf.stash_aware(loss_fn, top)
        gstep, state, out = psf.graphed(fstep), fstep.init(params, batch(0)), []
        for i in range(3):
            res = gstep(params, batch(i), state)
            state = res.state
            out.append(res.loss.item())
        return out

    def ladder():
        astep = psf.adaptive(loss_fn, top, psf.Ladder(rungs=rungs), graph=True)
        astate = astep.warm(params, batch(0), astep.init(params, batch(0)))
        assert astep.captures == len(rungs)
        out = []
        for i in range(3):                        # at the top rung: the first steps
            res, astate = astep(params, batch(i), astate)
            out.append(res.loss.item())
        return out

    fixed()            # cuBLAS's workspaces for the capture streams: made once a process
    fixed_peak, fixed_losses = peak(fixed)
    ladder_peak, ladder_losses = peak(ladder)
    assert ladder_losses == fixed_losses
    assert ladder_peak <= 1.01 * fixed_peak, (ladder_peak, fixed_peak)


def test_each_further_rung_of_a_graphed_ladder_holds_only_its_page_tables():
    """Eleven rungs' graphs, captured and stepped, hold over one rung's only each further
    rung's page tables (its state's, which its graph writes) and one set of zeroed flags and
    counts for the rungs at rest: the loss, aux, flags and routing counts of every graph go
    into buffers the pool's graphs share, none into the pool."""
    import dataclasses
    step, params, batch = setup(batch_size=128, scope="layer")
    loss_fn = demo.make_loss_fn(dtype=torch.bfloat16)
    top = dataclasses.replace(step.cfg, capacity_factor=2.0)
    many = (1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.4, 1.5, 1.75, 2.0)

    def held(rungs):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        astep = psf.adaptive(loss_fn, top, psf.Ladder(rungs=rungs), graph=True)
        astate = astep.warm(params, batch(0), astep.init(params, batch(0)))
        for i in range(3):
            res, astate = astep(params, batch(i), astate)
        del res
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - base, astep, astate

    def blocks(tensors):                 # bytes as the caching allocator rounds them
        return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)

    held((2.0,))                      # cuBLAS's workspaces: made once a process
    one, *_ = held((2.0,))
    eleven, astep, astate = held(many)
    rest = astate.states[0]           # a rung the run never took: at rest since warm
    assert astep.captures == len(many) and rest.flags is astep._zeros[0]
    tables = blocks(rest.tables.values())
    zeros = blocks([rest.flags, *rest.counts.values()])
    # before the outputs were shared, each further rung held about 7.7 KiB more here
    assert eleven - one <= (len(many) - 1) * (tables + 1024) + zeros, \
        (eleven - one, tables, zeros)


def test_a_graphed_ladder_refuses_another_batch_size_and_stays_usable():
    """A batch of another size reaches a graph's first warm-up, which the step refuses before
    anything ran: `StateMismatchError` naming an AdaptiveState per size, and the state left
    as it was (the next call with the right size runs and equals the eager ladder's)."""
    g = torch.Generator().manual_seed(5)
    params = psf.moe_init(16, 128, 96, generator=g, dtype=torch.bfloat16, device="cuda")

    def loss(p, x):
        return psf.moe(p, x, top_k=2).float().square().mean()

    cfg = psf.StashConfig(capacity_factor=2.0, paged_stash=True, expert_ranks=4,
                          pool_scope="layer")
    x = torch.randn(256, 128, generator=g).to("cuda", torch.bfloat16)
    out = []
    for graph in (False, True):
        astep = psf.adaptive(loss, cfg, psf.Ladder(rungs=(1.5, 2.0)), graph=graph)
        astate = astep.init(params, x)
        with pytest.raises(psf.StateMismatchError, match="AdaptiveState per shape"):
            astep(params, x[:128], astate)
        res, astate = astep(params, x, astate)
        out.append(res.loss)
    assert torch.equal(out[0], out[1])
