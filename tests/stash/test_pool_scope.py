"""``pool_scope="layer"``: each MoE call pages into a pool of its own, allocated by its forward
and freed by its backward. Same bits as the shared pool, freed when its layer's backward is
done (not when the whole backward is), and every way of handing pages back still works."""

import dataclasses
import os
import weakref

import pytest
import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf
from pagedstash_func.cli.bench._moe import stacked_layers

LAYERS, T, H, F, E, K = 3, 96, 32, 16, 8, 2


def setup(pad_fraction=0.3, seed=0):
    return stacked_layers(LAYERS, T, H, F, E, K, torch.float64, "cpu", seed, pad_fraction)


def config(scope, backend="torch", cuda_factor=0.75, page_size=8, **kw):
    # pages of 8 rows: a pool of 0.75 x the balanced rows stays smaller than the layer's
    # buffer, so it is paged (with 64-row pages the slack page would make it larger, and the
    # layer would keep the buffer whole: see the kept-whole tests)
    return psf.StashConfig(capacity_factor=1.25, paged_stash=True, expert_ranks=2,
                           cuda_factor=cuda_factor, pool_scope=scope, backend=backend,
                           page_size=page_size, **kw)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs the "
    "interpreter (the GPU tests run the kernels on CUDA)"))])
def test_layer_pools_give_the_bits_of_the_shared_pool_and_the_exact_answer(backend):
    params, batch, loss_fn = setup()
    exact = torch.func.grad(loss_fn)(params, batch)
    out = {}
    for scope in ("state", "layer"):
        step = psf.stash_aware(loss_fn, config(scope, backend))
        state = step.init(params, batch)
        for _ in range(2):                  # the second step reuses the state's tables
            res = psf.run_step(step, params, batch, state)
            state = res.state
        assert not res.report.reran
        psf.validate_state(state, between_steps=True)
        out[scope] = res
    assert same(out["state"].grads, out["layer"].grads)
    assert torch.equal(out["state"].loss, out["layer"].loss)
    for g, ref in zip(pytree.tree_leaves(out["layer"].grads), pytree.tree_leaves(exact)):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)
    # the report names one pool per tensor, with the same pages needed as the shared one
    shared, own = out["state"].report, out["layer"].report
    assert set(own.pages_needed) == {f"moe{i}/act_in" for i in range(LAYERS)}
    assert sum(own.pages_needed.values()) == sum(shared.pages_needed.values())
    assert own.stash_bytes == shared.stash_bytes and own.padded_bytes == shared.padded_bytes


_PROBE = {"refs": [], "seen": []}     # module-level: torch.func copies non-tensor inputs


class _Probe(torch.autograd.Function):
    """Identity whose backward notes which pools of ``_PROBE["refs"]`` are alive when it runs."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        _PROBE["seen"].append([r() is not None for r in _PROBE["refs"]])
        return g


def test_a_layer_pool_is_freed_when_its_backward_is_done():
    """Between the backwards of layer 1 and layer 0, layer 1's pool is gone and layer 0's is
    still there (the shared pool would hold both until the step ends)."""
    params, batch, _ = setup()
    refs, seen = _PROBE["refs"], _PROBE["seen"]
    refs.clear(), seen.clear()

    def loss_fn(params, batch):
        h = batch["x"]
        for i, p in enumerate(params[:2]):
            if i == 1:
                h = _Probe.apply(h)         # its backward runs between the two layers'
            ids, weights = psf.route(p["router"], h, K)
            ids = torch.where(batch["padding"][:, None], -1, ids)
            h = h + psf.moe(p, h, top_k=K, routing=(ids, weights))
        return (h * batch["cotangent"]).sum()

    step = psf.stash_aware(loss_fn, config("layer"))
    state = step.init(params, batch)
    _, pullback, new_state = torch.func.vjp(lambda p: step(p, batch, state), params,
                                            has_aux=True)
    pools = [r.private[f"moe{i}/act_in"].cuda for i, r in enumerate(new_state.pending)]
    refs += [weakref.ref(t) for t in pools]
    assert all(r() is not None for r in refs)
    del pools
    pullback(torch.ones((), dtype=torch.float64))
    assert seen == [[True, False]]            # layer 0's pool alive, layer 1's freed
    assert all(r() is None for r in refs)     # and layer 0's after its own backward


def test_an_undersized_layer_pool_overflows_and_reruns_exactly():
    params, batch, loss_fn = setup()
    step = psf.stash_aware(loss_fn, config("layer", cuda_factor=0.05))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.reran and res.report.overflow
    exact = torch.func.grad(loss_fn)(params, batch)
    assert same(res.grads, exact)
    psf.validate_state(res.state, between_steps=True)


def test_a_stash_no_backward_uses_is_reclaimed_and_its_pool_dropped():
    params, batch, loss_fn = setup()

    def loss_with_unused_layer(params, batch):
        unused = psf.moe(params[0], batch["x"], top_k=K)      # never reaches the loss
        return loss_fn(params[1:], batch), unused.sum().detach()

    step = psf.stash_aware(loss_with_unused_layer, config("layer"))
    state = step.init(params, batch)
    res = psf.run_step(step, params, batch, state)
    assert res.report.unconsumed == ("moe0",)
    psf.validate_state(res.state, between_steps=True)
    res2 = psf.run_step(step, params, batch, res.state)
    assert same(res.grads, res2.grads)


def test_clone_while_pages_are_held_gives_a_copy_that_holds_nothing():
    params, batch, loss_fn = setup()
    step = psf.stash_aware(loss_fn, config("layer"))
    state = step.init(params, batch)
    _, pullback, new_state = torch.func.vjp(lambda p: step(p, batch, state), params,
                                            has_aux=True)
    used = psf.pages_in_use(new_state)          # the layers' own pools, while they exist
    assert set(used) == {f"moe{i}/act_in" for i in range(LAYERS)}
    assert all(u["cuda_used"] > 0 and u["host_pages"] == 0 for u in used.values())
    view = psf.table_view(new_state, "moe1/act_in")
    assert view["pages"] == view["cuda_pages"] and not view["host_pages"]
    copy = new_state.clone()
    assert all(u["cuda_used"] == 0 for u in psf.pages_in_use(copy).values())
    psf.validate_state(copy, between_steps=True)
    grads = pullback(torch.ones((), dtype=torch.float64))[0]     # the original still pops
    res = psf.run_step(step, params, batch, copy)
    assert same(grads, res.grads)


def test_save_and_replay_a_layer_scoped_step(tmp_path):
    torch.use_deterministic_algorithms(True)
    try:
        params, batch, loss_fn = setup()
        step = psf.stash_aware(loss_fn, config("layer"))
        state = step.init(params, batch)
        path = tmp_path / "step.pt"
        psf.save_step(path, step, params, batch, state)
        res = psf.run_step(step, params, batch, state)
        again = psf.replay_step(path, loss_fn)
        assert same(res.grads, again.grads) and torch.equal(res.loss, again.loss)
        assert again.report.pages_available == res.report.pages_available
    finally:
        torch.use_deterministic_algorithms(False)


def test_config_and_misuse_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="pool_scope must be one of"):
        psf.StashConfig(capacity_factor=1.25, paged_stash=True, pool_scope="global")
    with pytest.raises(ValueError, match="host_factor=0"):
        psf.StashConfig(capacity_factor=1.25, paged_stash=True, pool_scope="layer",
                        host_factor=0.5)
    params, batch, loss_fn = setup()
    state = psf.stash_aware(loss_fn, config("layer")).init(params, batch)
    rows = torch.zeros(state.spec("moe0/act_in").capacity, 2 * F, dtype=torch.float64)
    with pytest.raises(ValueError, match="pool_scope='state'"):
        psf.stash(state, "moe0/act_in", rows, torch.tensor([3]))
    with pytest.raises(ValueError, match="pool_scope='state'"):
        psf.pop(state, "moe0/act_in")
    state.check_alive()          # refused before anything was consumed


def test_validate_names_a_bad_table_of_a_layer_pool():
    params, batch, loss_fn = setup()
    state = psf.stash_aware(loss_fn, config("layer", page_size=64)).init(params, batch)
    pages = state.layer_pools["moe1/act_in"].cuda_pages
    table = state.tables["moe1/act_in"]
    table[:3] = torch.tensor([64, 1, 1])
    table[4] = pages                             # one past the pool's last page
    with pytest.raises(ValueError, match=r"tables\['moe1/act_in'\].*outside"):
        psf.validate_state(state)
    table[4] = 0
    with pytest.raises(ValueError, match="holds pages between steps"):
        psf.validate_state(state, between_steps=True)


def test_reclaim_and_reset_let_go_of_a_layer_pool_and_empty_its_table():
    params, batch, loss_fn = setup()
    params = pytree.tree_map(lambda t: t.detach().requires_grad_(), params)   # a graph: stash
    step = psf.stash_aware(loss_fn, config("layer"))
    for give_back in (psf.reclaim, psf.reset):
        state = step.init(params, batch)
        loss, new_state = step(params, batch, state)       # forward only: pages stay held
        records = new_state.pending
        pools = [weakref.ref(s.cuda) for r in records for s in r.private.values()]
        assert len(pools) == LAYERS and all(p() is not None for p in pools)
        out = give_back(new_state)
        after = out[0] if isinstance(out, tuple) else out
        assert all(r.status == "released" and not r.private for r in records)
        psf.validate_state(after, between_steps=True)       # every table holds nothing
        del loss, records, out                                # the forward's graph goes too
        assert all(p() is None for p in pools)
        res = psf.run_step(step, params, batch, after)       # and the state runs on
        assert not res.report.reran


def test_a_state_of_the_other_scope_is_refused_before_it_is_consumed():
    params, batch, loss_fn = setup()
    shared = psf.stash_aware(loss_fn, config("state"))
    own = psf.stash_aware(loss_fn, config("layer"))
    for step, other in ((shared, own), (own, shared)):
        state = other.init(params, batch)
        with pytest.raises(ValueError, match="pool_scope=.*step.init"):
            psf.run_step(step, params, batch, state)
        state.check_alive()


def test_the_report_sizes_each_layer_pool_from_its_layout():
    params, batch, loss_fn = setup()
    step = psf.stash_aware(loss_fn, config("layer", cuda_factor=0.6))
    state = step.init(params, batch)
    res = psf.run_step(step, params, batch, state)
    for name, lay in state.layer_pools.items():
        assert res.report.pages_available[name] == (lay.cuda_pages, 0)
        # cuda_factor x T*k rows, rounded up to pages, plus one slack page
        assert lay.cuda_pages == -(-int(0.6 * T * K) // lay.page_size) + 1


def test_validate_refuses_edited_layer_pools():
    import dataclasses
    from pagedstash_func.stash._state import StashState
    params, batch, loss_fn = setup()
    state = psf.stash_aware(loss_fn, config("layer", page_size=64)).init(params, batch)
    own = state.layer_pools

    def rebuilt(layer_pools, layouts=(), pools=None):
        return StashState.create(pools=pools or {}, tables=dict(state.tables),
                                 flags=state.flags, counts=dict(state.counts), layouts=layouts,
                                 specs=state.specs, page_size=state.page_size,
                                 backend=state.backend, layers=state.layers,
                                 layer_pools=tuple(layer_pools.items()))
    lay = own["moe0/act_in"]
    for pages in (0, -3, 2**31 + 5, True, 2.5):
        bad = dict(own, **{"moe0/act_in": dataclasses.replace(lay, cuda_pages=pages)})
        with pytest.raises(ValueError, match="pool of its layer's own of"):
            psf.validate_state(rebuilt(bad))
    with pytest.raises(ValueError, match=r"layer_pools name tensors the state does not stash"):
        psf.validate_state(rebuilt(dict(own, **{"moe9/act_in": lay})))
    shared = psf.stash_aware(loss_fn, config("state")).init(params, batch)
    with pytest.raises(ValueError, match="one scope per state"):
        psf.validate_state(rebuilt(own, shared.layouts, shared.pools))
    table = state.tables["moe1/act_in"]
    table[:6] = torch.tensor([100, 2, 2, 0, 3, 3])       # page 3 held twice
    with pytest.raises(ValueError, match="some twice"):
        psf.validate_state(state)


def alive_at_each_wgrad(monkeypatch, refs) -> list:
    """A list that gets, at each weight-gradient GEMM of a backward, which of the weak
    references ``refs`` (filled in later) are alive then."""
    import pagedstash_func.experts._experts as experts
    seen, wgrad = [], experts.grouped_mm_wgrad

    def noting_wgrad(*args, **kw):
        seen.append([r() is not None for r in refs])
        return wgrad(*args, **kw)
    monkeypatch.setattr(experts, "grouped_mm_wgrad", noting_wgrad)
    return seen


def gone_layer_by_layer() -> list:
    """What `alive_at_each_wgrad` sees when each layer's pool or buffer goes before its two
    weight-gradient GEMMs: last layer first, the layers before it still held."""
    alive = [[i < layer for i in range(LAYERS)] for layer in reversed(range(LAYERS))]
    return [a for a in alive for _ in range(2)]


def test_a_layer_pool_is_freed_as_soon_as_its_last_reader_has_run(monkeypatch):
    """Inside one layer's backward: gate_up's pool is gone once the SwiGLU backward has read it
    and given its pages back, before the weight-gradient GEMMs (which set the layer's peak),
    not when the layer's backward returns."""
    params, batch, loss_fn = setup()
    refs = []
    seen = alive_at_each_wgrad(monkeypatch, refs)
    step = psf.stash_aware(loss_fn, config("layer"))
    state = step.init(params, batch)
    _, pullback, new_state = torch.func.vjp(lambda p: step(p, batch, state), params,
                                            has_aux=True)
    refs += [weakref.ref(r.private[f"moe{i}/act_in"].cuda)
             for i, r in enumerate(new_state.pending)]
    assert all(r() is not None for r in refs)
    grads = pullback(torch.ones((), dtype=torch.float64))[0]
    assert seen == gone_layer_by_layer()
    shared = psf.stash_aware(loss_fn, config("state"))
    assert same(grads, psf.run_step(shared, params, batch, shared.init(params, batch)).grads)
    exact = torch.func.grad(loss_fn)(params, batch)
    for g, ref in zip(pytree.tree_leaves(grads), pytree.tree_leaves(exact)):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)


def test_a_pool_never_larger_than_its_buffer_keeps_the_buffer_whole(monkeypatch):
    """Without padding a pool that holds every valid row is at least the layer's buffer (on one
    device the buffer has ``align(T*k)`` rows): the layer keeps the buffer instead of paging it
    (no pool, no page copy), lets it go as soon as the SwiGLU backward has read it, and gives
    the shared pool's bits and the exact answer. A pool smaller than the buffer is paged."""
    from pagedstash_func.stash._pools import kept_whole
    params, batch, loss_fn = setup(pad_fraction=0.0)
    cfg = config("layer", cuda_factor=1.1)
    step = psf.stash_aware(loss_fn, cfg)
    state = step.init(params, batch)
    rows = state.layers[0].capacity
    lay = state.layer_pools["moe0/act_in"]
    assert lay.cuda_pages * lay.page_size >= rows and kept_whole(lay, rows)
    # the boundary: one page fewer than the buffer's rows is paged
    assert not kept_whole(dataclasses.replace(lay, cuda_pages=-(-rows // lay.page_size) - 1),
                          rows)
    refs = []
    seen = alive_at_each_wgrad(monkeypatch, refs)
    _, pullback, new_state = torch.func.vjp(lambda p: step(p, batch, state), params,
                                            has_aux=True)
    for r in new_state.pending:
        assert r.private == {} and set(r.buffers) == {"act_in"}     # no pool: the buffer
        assert r.buffers["act_in"].shape == (rows, 2 * F)
    refs += [weakref.ref(r.buffers["act_in"]) for r in new_state.pending]
    assert psf.pages_in_use(new_state)["moe0/act_in"]["cuda_used"] == 0
    grads = pullback(torch.ones((), dtype=torch.float64))[0]
    assert seen == gone_layer_by_layer()
    assert not psf.read_flags(new_state)["overflow"]
    shared = psf.stash_aware(loss_fn, config("state", cuda_factor=1.1))
    assert same(grads, psf.run_step(shared, params, batch, shared.init(params, batch)).grads)
    exact = torch.func.grad(loss_fn)(params, batch)
    for g, ref in zip(pytree.tree_leaves(grads), pytree.tree_leaves(exact)):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)
    # the report says which tensors were kept whole, and counts their buffers as held
    report = psf.run_step(step, params, batch, step.init(params, batch)).report
    assert report.kept_whole == tuple(f"moe{i}/act_in" for i in range(LAYERS))
    assert report.stash_bytes == report.padded_bytes == LAYERS * rows * 2 * F * 8
    paged = psf.stash_aware(loss_fn, config("layer"))
    padded_batch = setup()[1]
    assert psf.run_step(paged, params, padded_batch,
                        paged.init(params, padded_batch)).report.kept_whole == ()


def test_kept_buffers_go_with_reclaim_reset_and_a_run_step():
    """A kept buffer whose backward never runs is let go by reclaim (and reset); run_step
    threads such a step like any other."""
    params, batch, loss_fn = setup(pad_fraction=0.0)
    step = psf.stash_aware(loss_fn, config("layer", cuda_factor=1.1))
    state = step.init(params, batch)
    def forward_only(state):
        """A differentiable forward whose pullback is never called."""
        _, pullback, new_state = torch.func.vjp(lambda p: step(p, batch, state), params,
                                                has_aux=True)
        held = [weakref.ref(r.buffers["act_in"]) for r in new_state.pending]
        assert len(held) == LAYERS and all(r() is not None for r in held)
        return pullback, new_state, held

    pullback, new_state, held = forward_only(state)
    reclaimed, layers = psf.reclaim(new_state)
    assert layers == tuple(f"moe{i}" for i in range(LAYERS))
    assert all(r() is None for r in held)       # while the forward's graph still lives
    with pytest.raises(RuntimeError, match="reclaimed"):
        pullback(torch.ones((), dtype=torch.float64))
    res = psf.run_step(step, params, batch, reclaimed)
    assert not res.report.reran
    psf.validate_state(res.state, between_steps=True)
    pullback, again, held = forward_only(res.state)
    psf.reset(again)
    assert all(r() is None for r in held)


def test_kept_whole_at_the_exact_boundary_and_what_the_report_counts():
    """Pages of one row: a pool of exactly the buffer's rows is kept whole, one row less is
    paged; with padding the kept buffer counts whole in stash_bytes (the pages the paged one
    needs are fewer)."""
    params, batch, loss_fn = setup()                 # 30 % padding
    rows = T * K                                     # 192: the buffer on one device
    out = {}
    for name, factor in (("kept", (rows - 1) / rows), ("paged", (rows - 2) / rows)):
        step = psf.stash_aware(loss_fn, config("layer", cuda_factor=factor, page_size=1))
        state = step.init(params, batch)
        lay = state.layer_pools["moe0/act_in"]
        assert state.layers[0].capacity == rows
        assert lay.cuda_pages == rows - (name == "paged")       # pool rows, slack included
        out[name] = psf.run_step(step, params, batch, state)
        assert not out[name].report.reran
    kept, paged = out["kept"].report, out["paged"].report
    assert kept.kept_whole == tuple(f"moe{i}/act_in" for i in range(LAYERS))
    assert paged.kept_whole == ()
    assert kept.stash_bytes == kept.padded_bytes == LAYERS * rows * 2 * F * 8
    assert paged.stash_bytes < paged.padded_bytes
    assert same(out["kept"].grads, out["paged"].grads)


def test_init_refuses_layer_pools_beyond_the_device_counting_kept_buffers_as_buffers(
        monkeypatch):
    """The init check (CUDA only; its arithmetic run here against a pretend device): pools
    larger than the device's memory are refused naming cuda_factor; a pool that would be kept
    whole counts as its buffer, so a huge cuda_factor that pages nothing is not refused."""
    import types

    from pagedstash_func.stash import _pools
    params, batch, loss_fn = setup()
    specs = psf.stash_aware(loss_fn, config("layer")).init(params, batch).specs
    small = psf.StashConfig(capacity_factor=1.25, paged_stash=True, pool_scope="layer",
                            page_size=8, cuda_factor=0.75)
    pools = tuple((s.name, _pools.pool_layouts([s], small)[0]) for s in specs)
    pool_bytes = sum(lay.cuda_pages * lay.page_bytes for _, lay in pools)
    buffer_bytes = sum(s.capacity * s.width * 8 for s in specs)
    assert pool_bytes < buffer_bytes                      # these pools are paged
    memory = {"total": pool_bytes - 1}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=memory["total"]))
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="cuda_factor=0.75 asks for .* more than the device"):
        _pools._check_layer_pools_fit(pools, specs, small, cuda)
    memory["total"] = pool_bytes
    _pools._check_layer_pools_fit(pools, specs, small, cuda)          # fits exactly
    huge = dataclasses.replace(small, cuda_factor=1000.0)
    kept = tuple((s.name, _pools.pool_layouts([s], huge)[0]) for s in specs)
    memory["total"] = buffer_bytes
    _pools._check_layer_pools_fit(kept, specs, huge, cuda)            # the buffers fit
    memory["total"] = buffer_bytes - 1
    with pytest.raises(ValueError, match="cuda_factor=1000.0"):
        _pools._check_layer_pools_fit(kept, specs, huge, cuda)
