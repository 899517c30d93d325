"""Misuse and faults: each case is the right answer or a clear error."""

import subprocess
import sys

import pytest
import torch

import pagedstash_func as psf
from pagedstash_func.step import _replay

E, H, F, K, T = 8, 16, 24, 2, 32


def make(layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [psf.moe_init(E, H, F, generator=g, dtype=torch.float64) for _ in range(layers)]
    return params, {"x": torch.randn(T, H, generator=g, dtype=torch.float64)}


def loss_fn(params, batch):
    x = batch["x"]
    for p in params:
        x = x + psf.moe(p, torch.tanh(x), top_k=K)
    return (x ** 2).mean()


def stepper(stash=True, fn=loss_fn, **kw):
    cfg = dict(capacity_factor=4.0, paged_stash=stash, page_size=8)
    cfg.update(kw)
    return psf.stash_aware(fn, psf.StashConfig(**cfg))


def free(state):
    return all(v["cuda_used"] == 0 and v["host_used"] == 0
               for v in psf.pages_in_use(state).values())


# ----------------------------------------------------------------------------- 1. second backward


def test_second_backward_through_a_stashed_step_is_refused():
    params, batch = make()
    step = stepper()
    state = step.init(params, batch)
    _, vjp_fn, _ = torch.func.vjp(lambda p: step(p, batch, state), params, has_aux=True)
    vjp_fn(torch.ones((), dtype=torch.float64))
    with pytest.raises(RuntimeError, match="second backward through moe1"):
        vjp_fn(torch.ones((), dtype=torch.float64))
    leaves = [p.requires_grad_() for layer in params for p in layer.values()]
    loss, _ = step(params, batch, step.init(params, batch))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="run that step with paged_stash=False"):
        loss.backward()
    for p in leaves:
        p.requires_grad_(False)


def test_second_backward_without_stash_is_exact():
    params, batch = make()
    step = stepper(stash=False)
    state = step.init(params, batch)
    _, vjp_fn, _ = torch.func.vjp(lambda p: step(p, batch, state), params, has_aux=True)
    first = vjp_fn(torch.ones((), dtype=torch.float64))[0]
    second = vjp_fn(torch.ones((), dtype=torch.float64))[0]
    for a, b in zip(first, second):
        assert all(torch.equal(a[n], b[n]) for n in a)


# ----------------------------------------------------------------------------- 2. higher order


@pytest.mark.parametrize("stash", [None, False, True])
def test_higher_order_derivatives_are_refused(stash):
    params, batch = make(layers=1)
    if stash is None:
        f = loss_fn
    else:
        step = stepper(stash=stash)
        state = step.init(params, batch)
        f = lambda p, b: step(p, b, state.clone())[0]   # noqa: E731
    x = batch["x"]
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.func.grad(lambda x: torch.func.grad(f, argnums=1)(params, {"x": x})["x"].sum())(x)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.hessian(lambda x: f(params, {"x": x}))(x)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: f(params, {"x": x}), (x,), (x,))
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(params, {"x": xr}), xr, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        g.sum().backward()


# ----------------------------------------------------------------------------- 3. unused outputs


def aux_only_loss(params, batch):
    x = batch["x"]
    y0 = psf.moe(params[0], torch.tanh(x), top_k=K)
    y1 = psf.moe(params[1], torch.tanh(x), top_k=K)     # reaches aux only: no backward
    return (y0 ** 2).mean(), {"y1": y1.detach().sum()}


def test_run_step_reclaims_pages_whose_backward_never_ran():
    params, batch = make()
    step = stepper(fn=aux_only_loss, cuda_factor=1.0)
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.unconsumed == ("moe1",) and free(res.state)
    for _ in range(3):                                   # no leak: never overflows later
        res = psf.run_step(step, params, batch, res.state)
        assert not res.report.overflow and free(res.state)
    grads = torch.func.grad(lambda p, b: aux_only_loss(p, b)[0])(params, batch)
    assert all(torch.equal(res.grads[1][n], grads[1][n]) for n in grads[1])


def test_raw_form_reclaims_only_when_asked_and_a_late_pop_raises():
    params, batch = make()
    step = stepper()
    state = step.init(params, batch)
    _, vjp_fn, state = torch.func.vjp(lambda p: step(p, batch, state), params, has_aux=True)
    assert not free(state) and [r.layer for r in state.pending] == ["moe0", "moe1"]
    state, reclaimed = psf.reclaim(state)
    assert reclaimed == ("moe0", "moe1") and free(state)
    with pytest.raises(RuntimeError, match="after its stashed pages were reclaimed"):
        vjp_fn(torch.ones((), dtype=torch.float64))


# ----------------------------------------------------------------------------- 4. shapes


def test_parameter_shapes_are_checked_against_each_other_and_the_state():
    params, batch = make(layers=1)
    p = params[0]
    x = batch["x"]
    extra = dict(p, router=torch.randn(E + 1, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"router has 9 rows .* router \[9, 16\], w_gate_up "
                                         r"\[8, 16, 48\]"):
        psf.moe(extra, x, top_k=K)
    with pytest.raises(ValueError, match=r"router has 4 rows"):
        psf.moe(dict(p, router=p["router"][:4]), x, top_k=K)
    with pytest.raises(ValueError, match=r"w_down must be \[E, F, H\] = \[8, 24, 16\]"):
        psf.moe(dict(p, w_down=p["w_down"][:, :20]), x, top_k=K)
    with pytest.raises(ValueError, match=r"w_gate_up must be \[E, H, 2F\]"):
        psf.moe(dict(p, w_gate_up=p["w_gate_up"][:, :, :47]), x, top_k=K)
    step = stepper()
    state = step.init(params, batch)
    other = [psf.moe_init(4, H, F, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"experts 4 \(state: 8\)"):
        step(other, batch, state)


# ----------------------------------------------------------------------------- 7. statistics


def test_run_step_counts_its_own_attempt_whatever_state_it_gets():
    params, batch = make()
    step = stepper(expert_ranks=2)
    state = step.init(params, batch)
    fresh = psf.run_step(step, params, batch, state.clone()).report
    _, (_, state) = torch.func.grad_and_value(step, has_aux=True)(params, batch, state)
    assert any(v.any() for v in state.counts.values())   # the plain call counted
    again = psf.run_step(step, params, batch, state).report
    assert again.layers == fresh.layers and again.stash_bytes == fresh.stash_bytes


# ----------------------------------------------------------------------------- 8. files


def saved(tmp_path, **changes):
    params, batch = make(layers=1)
    step = stepper(host_factor=0.5)
    path = tmp_path / "step.pt"
    psf.save_step(path, step, params, batch, step.init(params, batch))
    blob = torch.load(path, weights_only=True)
    leaves = blob["state"]["leaves"]
    for index, edit in changes.items():
        edit(leaves[int(index.removeprefix("leaf"))])
    if changes:     # forge a consistent checksum, so that only validation can catch the edit
        blob["checksum"] = _replay._checksum({k: v for k, v in blob.items()
                                                  if k != "checksum"})
    torch.save(blob, path)
    return path


def test_a_saved_step_replays_and_its_file_holds_no_code(tmp_path):
    path = saved(tmp_path)
    res = psf.replay_step(path, loss_fn)
    assert not res.report.reran
    assert b"pagedstash_func.stash._state" not in path.read_bytes()   # no pickled classes


FREE, CURSORS = 3, 4      # leaves: 0 flags, then the first pool's cuda, host, free_pages, cursors


@pytest.mark.parametrize("leaf, edit, field", [
    (FREE, lambda t: t.__setitem__(1, t[0]), r"pools\[float64x48\].free_pages .* twice"),
    (FREE, lambda t: t.__setitem__(0, 10**6), r"pools\[float64x48\].free_pages hold ids outside"),
    (FREE, lambda t: t.__setitem__(0, t[0] - 1), r"pools\[float64x48\].free_pages .* lose pages"),
    (CURSORS, lambda t: t.__setitem__(2, 3),
     r"pools\[float64x48\].cursors have \[3, 0\] in their spare slots"),
    (CURSORS, lambda t: t.__setitem__(0, -5), r"pools\[float64x48\].cursors are \[-5"),
    (0, lambda t: t.__setitem__(0, 7), r"state.flags holds values other than 0/1"),
])
def test_corrupted_state_is_refused_naming_the_field(tmp_path, leaf, edit, field):
    path = saved(tmp_path, **{f"leaf{leaf}": edit})
    with pytest.raises(ValueError, match=field):
        psf.load_step(path, loss_fn)


def test_a_changed_byte_is_caught_by_the_checksum(tmp_path):
    path = saved(tmp_path)
    blob = torch.load(path, weights_only=True)
    weight = blob["params"]["v"][0]["v"][1]["v"]           # layer 0, w_gate_up
    weight.view(-1)[123] += 1e-9
    torch.save(blob, path)
    with pytest.raises(ValueError, match="is corrupted: its contents do not match"):
        psf.load_step(path, loss_fn)
    data = bytearray(saved(tmp_path).read_bytes())
    data[len(data) // 2] ^= 0x10                          # a flipped bit somewhere in the file
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted|not a readable"):
        psf.load_step(path, loss_fn)


def test_truncated_foreign_and_code_carrying_files_are_refused(tmp_path):
    good = saved(tmp_path)
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(good.read_bytes()[:500])
    with pytest.raises(ValueError, match="not a readable pagedstash_func step file"):
        psf.load_step(truncated, loss_fn)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(ValueError, match="not a pagedstash_func step file"):
        psf.load_step(foreign, loss_fn)
    evil = tmp_path / "evil.pt"
    torch.save({"format": "pagedstash_func.step", "payload": subprocess.Popen}, evil)
    with pytest.raises(ValueError, match="not a readable pagedstash_func step file"):
        psf.load_step(evil, loss_fn)


@pytest.mark.parametrize("where", ["batch", "state"])
def test_a_dtype_entry_naming_anything_but_a_dtype_is_refused(tmp_path, where):
    """A crafted file (checksum recomputed) whose dtype entry names a function of torch's:
    refused, never handed to the loss or the state as that function."""
    params, batch = make(layers=1)
    step = stepper()
    path = tmp_path / "step.pt"
    psf.save_step(path, step, params, dict(batch, dt=torch.float64), step.init(params, batch))
    blob = torch.load(path, weights_only=True)
    if where == "batch":
        entry = blob["batch"]["v"][blob["batch"]["k"].index("dt")]
        assert entry == {"t": "dtype", "v": "float64"}
        entry["v"] = "load"
    else:
        blob["state"]["specs"][0]["dtype"] = "save"
    blob["checksum"] = _replay._checksum({k: v for k, v in blob.items() if k != "checksum"})
    torch.save(blob, path)
    with pytest.raises(ValueError, match="is not a torch dtype"):
        psf.load_step(path, loss_fn)


def test_unstorable_batch_is_refused_at_save_and_the_loss_is_checked(tmp_path):
    params, batch = make(layers=1)
    step = stepper()
    with pytest.raises(TypeError, match=r"batch\['fn'\] is a function"):
        psf.save_step(tmp_path / "s.pt", step, params, dict(batch, fn=lambda: 0),
                      step.init(params, batch))
    path = tmp_path / "s.pt"
    batch["gen"] = torch.Generator().manual_seed(3)
    psf.save_step(path, step, params, batch, step.init(params, batch))
    with pytest.raises(ValueError, match="was saved with the loss"):
        psf.load_step(path, aux_only_loss)
    _, _, loaded, _ = psf.load_step(path, aux_only_loss, check_loss_fn=False)
    assert torch.equal(loaded["gen"].get_state(), batch["gen"].get_state())


# ----------------------------------------------------------------------------- 9. failures


def test_a_refused_call_leaves_the_state_usable():
    params, batch = make()
    step = stepper()
    state = step.init(params, batch)
    with pytest.raises(ValueError, match="does not match the state"):
        step(params, {"x": batch["x"][:8]}, state)
    loss, state = step(params, batch, state)         # still live
    assert torch.isfinite(loss)


def test_a_failure_halfway_says_so_and_reset_recovers_without_sharing_pools():
    params, batch = make()

    def flaky(params, batch):
        psf.moe(params[0], batch["x"], top_k=K)
        raise KeyError("user bug after the first layer")

    step = stepper(fn=flaky)
    state = stepper().init(params, batch)             # the state of the two-layer loss
    with pytest.raises(KeyError):
        torch.func.grad(step, has_aux=True)(params, batch, state)
    with pytest.raises(psf.ConsumedStateError, match="(?s)failed halfway .* psf.reset"):
        stepper().attempt(params, batch, state)
    fresh = psf.reset(state)
    assert free(fresh)
    pool = fresh.pools[fresh.layouts[0].key].cuda
    assert pool.data_ptr() != state.pools[state.layouts[0].key].cuda.data_ptr()
    res = psf.run_step(stepper(), params, batch, fresh)
    assert free(res.state) and not res.report.reran


# ----------------------------------------------------------------------------- clear errors


def test_clear_errors_for_wrong_types():
    params, batch = make(layers=1)
    step = stepper()
    with pytest.raises(TypeError, match="needs the StashState from step.init"):
        psf.run_step(step, params, batch, {})
    for bad in ("text", 1.5, None):
        def with_aux(p, b, bad=bad):
            return loss_fn(p, b), {"note": bad}
        s = stepper(fn=with_aux)
        with pytest.raises(TypeError, match=r"aux\['note'\] is a"):
            psf.run_step(s, params, batch, s.init(params, batch))
    p = params[0]
    with pytest.raises(TypeError, match="top_k must be an int, got bool"):
        psf.moe(p, batch["x"], top_k=True)
    with pytest.raises(ValueError, match=r"x must be a tensor \[..., H\]"):
        psf.moe(p, torch.tensor(1.0, dtype=torch.float64), top_k=K)
    ids = torch.zeros(T, K, dtype=torch.uint8)
    with pytest.raises(TypeError, match="routing ids must be int32 or int64"):
        psf.moe(p, batch["x"], top_k=K, routing=(ids, torch.ones(T, K, dtype=torch.float64)))


@pytest.mark.parametrize("args, text", [
    (["demo", "--steps", "0"], "expected a positive integer, got 0"),
    (["demo", "--device", "gpu"], "expected cpu or cuda"),
    (["demo", "--capacity-factor", "-1"], "capacity_factor must be a positive finite"),
    (["demo", "--expert-ranks", "3"], "does not divide the demo's 8 experts"),
    (["bench", "stash"], "needs a GPU"),
    (["bench", "stash", "--expected", "1,-0.5"], "expected comma-separated factors >= 0"),
    (["bench", "stash", "--sweep", "--valid", "0.8"], "drop --valid, --expected and --pdl"),
    (["bench", "stash", "--pdl", "of"], "expected on, off or on,off"),
    (["bench", "stash", "--sweep", "--floor"], "they do not combine with --sweep"),
    (["bench", "moe", "--device", "cpu"], "needs a GPU"),
    (["bench", "lm-loss", "--device", "cpu"], "needs a GPU"),
    (["bench", "lm-loss", "--model", "llama"], "choose one of olmoe"),
    (["demo", "--cuda-factor=1e6"], "could not be allocated: a pool holds cuda_factor times"),
])
def test_cli_errors_are_one_line_without_traceback(args, text):
    if "gpu" in text.lower() and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")

    run = subprocess.run([sys.executable, "-m", "pagedstash_func", *args], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and text in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_graphed_steps_say_what_they_need():
    params, batch = make(layers=1)
    step = stepper()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="need a CUDA device"):
            psf.graphed(step)
    with pytest.raises(TypeError, match="graphed needs a step made by psf.stash_aware"):
        psf.graphed(loss_fn)


# ----------------------------------------------------------------------------- adversarial pass


def test_a_second_forward_into_a_state_with_pages_in_flight_is_refused():
    params, batch = make()
    step = stepper()

    def two(params, state):
        l1, state = step(params, batch, state)
        l2, state = step(params, batch, state)
        return l1 + l2, state

    with pytest.raises(ValueError, match="moe0 still holds the pages of an earlier forward"):
        torch.func.grad(two, has_aux=True)(params, step.init(params, batch))


def test_reset_of_a_state_with_pages_in_flight_makes_their_backward_raise():
    params, batch = make()
    step = stepper()
    _, vjp_fn, state = torch.func.vjp(lambda p: step(p, batch, step.init(params, batch)),
                                      params, has_aux=True)
    fresh = psf.reset(state)
    psf.run_step(step, params, batch, fresh)              # reuses the pools
    with pytest.raises(RuntimeError, match="after its stashed pages were reclaimed"):
        vjp_fn(torch.ones((), dtype=torch.float64))


def test_a_clone_with_pages_in_flight_starts_with_nothing_pending():
    params, batch = make()
    step = stepper()
    _, vjp_fn, state = torch.func.vjp(lambda p: step(p, batch, step.init(params, batch)),
                                      params, has_aux=True)
    twin = state.clone()
    assert not twin.pending and free(twin)
    vjp_fn(torch.ones((), dtype=torch.float64))          # the original's backward still works
    res = psf.run_step(step, params, batch, twin)
    assert free(res.state) and not res.report.overflow


def dropout_loss(params, batch):
    x = batch["x"]
    keep = torch.rand(x.shape, generator=batch["gen"], dtype=x.dtype) > 0.3
    return (psf.moe(params[0], x * keep, top_k=K) ** 2).mean()


def test_a_rerun_draws_the_same_numbers_as_the_attempt():
    params, batch = make(layers=1)
    for cf in (100.0, 0.05):                           # no rerun / rerun every time
        batch["gen"] = torch.Generator().manual_seed(7)
        step = stepper(fn=dropout_loss, capacity_factor=cf)
        state = step.init(params, batch)               # init draws nothing the step would miss
        res = psf.run_step(step, params, batch, state)
        after = batch["gen"].get_state()
        batch["gen"] = torch.Generator().manual_seed(7)
        grads = torch.func.grad(dropout_loss)(params, batch)
        assert res.report.reran == (cf < 1)
        assert all(torch.equal(res.grads[0][n], grads[0][n]) for n in grads[0])
        assert torch.equal(after, batch["gen"].get_state())


def test_a_state_whose_tensors_share_memory_is_refused(tmp_path):
    params, batch = make()
    step = stepper()
    path = tmp_path / "alias.pt"
    psf.save_step(path, step, params, batch, step.init(params, batch))
    blob = torch.load(path, weights_only=True)
    names = [s["name"] for s in blob["state"]["specs"]]
    first = 1 + 4 * len(blob["state"]["layouts"])
    leaves = blob["state"]["leaves"]
    leaves[first + names.index("moe1/act_in")] = leaves[first + names.index("moe0/act_in")]
    blob["checksum"] = _replay._checksum({k: v for k, v in blob.items() if k != "checksum"})
    torch.save(blob, path)
    with pytest.raises(ValueError, match="shares memory with leaf"):
        psf.load_step(path, loss_fn)


def test_expert_weights_must_share_a_dtype():
    params, batch = make(layers=1)
    p = dict(params[0], w_down=params[0]["w_down"].float())
    with pytest.raises(ValueError, match="must share a device, and the experts a dtype"):
        psf.moe(p, batch["x"], top_k=K)


def test_advice_is_positive_and_covers_the_neediest_layer():
    prof = psf.RoutingProfile()
    empty = psf.LayerReport("moe0", (0, 0), (0, 0), rows=0, balanced_rows=0, budget=0,
                            capacity=0)
    prof.add(psf.StepReport(False, False, False, False, (empty,), {}, {}, 0, 0))
    assert prof.recommend(0.0) == {"capacity_factor": 0.001, "cuda_factor": 0.001}
    prof = psf.RoutingProfile()
    busy = psf.LayerReport("moe0", (30, 30), (30, 30), rows=60, balanced_rows=60, budget=32,
                           capacity=64)
    idle = psf.LayerReport("moe1", (3, 3), (3, 3), rows=6, balanced_rows=60, budget=32,
                           capacity=64)
    prof.add(psf.StepReport(False, False, False, False, (busy, idle), {}, {}, 0, 0))
    assert prof.recommend(0.0)["cuda_factor"] == 1.0      # not (60 + 6) / 120 = 0.55


def test_x_changed_in_place_after_a_stashed_layer_is_refused_and_pages_come_back():
    """On one device a stashing layer keeps x to gather its rows again: x += moe(x) (routing
    not computed from x) is refused in backward with the fix, and its pages stay reclaimable."""
    params, batch = make(layers=1)
    ids, w = psf.route(params[0]["router"], batch["x"], K)

    def in_place(p, b):
        x = b["x"].clone()
        x += psf.moe(p[0], x, top_k=K, routing=(ids, w))
        return (x ** 2).mean()

    step = stepper(fn=in_place)
    state = step.init(params, batch)
    leaves = [t.requires_grad_() for t in params[0].values()]
    loss, state = step(params, batch, state)
    with pytest.raises(RuntimeError, match=r"moe0's input x was changed in place .* Write "
                                           r"x = x \+ psf.moe"):
        loss.backward()
    state, layers = psf.reclaim(state)
    assert layers == ("moe0",) and free(state) and psf.validate_state(state) is None
    assert all(t.grad is None for t in leaves)
    rep = psf.run_step(stepper(), params, batch, stepper().init(params, batch)).report
    assert set(rep.pool_contents.values()) == {("act_in",)}      # only what is stashed counts


@pytest.mark.parametrize("scope, cuda_factor, paged", [
    ("state", 0.9, True), ("layer", 0.75, True), ("layer", 1.1, False)])
def test_a_backward_that_fails_halfway_is_reclaimed_and_a_retry_is_refused(
        monkeypatch, scope, cuda_factor, paged):
    """The first layer's backward (moe1 runs first) raises after gate_up's pages went back:
    the record is pending again, reclaim gives back what its tables still hold (no page is
    lost, the next steps never overflow), and calling the pullback again is refused with the
    fix instead of reading pages that are gone."""
    import pagedstash_func.experts._experts as experts
    params, batch = make()
    pad = torch.zeros(T, dtype=torch.bool)
    pad[::3] = True                 # padding: a pool smaller than the buffer holds every row

    def padded_loss(params, batch):
        x = batch["x"]
        for p in params:
            ids, w = psf.route(p["router"], torch.tanh(x), K)
            x = x + psf.moe(p, torch.tanh(x), top_k=K, routing=(torch.where(
                pad[:, None], -1, ids), w))
        return (x ** 2).mean()

    step = stepper(fn=padded_loss, cuda_factor=cuda_factor, pool_scope=scope)
    state = step.init(params, batch)
    _, pullback, new_state = torch.func.vjp(lambda p: step(p, batch, state), params,
                                            has_aux=True)
    if scope == "layer":            # this case pages into the layer's own pool, or keeps whole
        assert all(bool(r.private) == paged and bool(r.buffers) != paged
                   for r in new_state.pending)
    wgrad = experts.grouped_mm_wgrad

    def failing_wgrad(*args, **kw):
        raise MemoryError("out of memory in the weight-gradient GEMM")
    monkeypatch.setattr(experts, "grouped_mm_wgrad", failing_wgrad)
    with pytest.raises(MemoryError):
        pullback(torch.ones((), dtype=torch.float64))
    monkeypatch.setattr(experts, "grouped_mm_wgrad", wgrad)
    assert [(r.layer, r.status) for r in new_state.pending] == [("moe0", "held"),
                                                                  ("moe1", "failed")]
    with pytest.raises(RuntimeError, match="failed halfway.*psf.reclaim"):
        pullback(torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match="failed halfway.*psf.reclaim"):
        step(params, batch, new_state)          # a new forward into it names the fix too
    reclaimed, layers = psf.reclaim(new_state)
    assert layers == ("moe0", "moe1") and free(reclaimed)
    psf.validate_state(reclaimed, between_steps=True)
    res = psf.run_step(step, params, batch, reclaimed)
    for _ in range(2):
        assert not res.report.reran and free(res.state)
        res = psf.run_step(step, params, batch, res.state)
    exact = torch.func.grad(padded_loss)(params, batch)
    for g, ref in zip(res.grads, exact):
        for n in ref:
            torch.testing.assert_close(g[n], ref[n], rtol=1e-10, atol=1e-12)


def test_jacrev_over_a_stashed_pullback_names_what_is_refused():
    params, batch = make(layers=1)
    step = stepper()
    state = step.init(params, batch)
    _, pullback = torch.func.vjp(lambda p: step(p, batch, state)[0], params)
    with pytest.raises(NotImplementedError, match="psf.moe is differentiable once.*vmap"):
        torch.func.vmap(pullback)(torch.ones(2, dtype=torch.float64))


def test_bench_stash_shares_are_medians_of_rounds_with_the_resets_taken_out():
    """`bench stash` reads each share as the median over rounds of copy_'s time over the
    path's, a stash's and a pop's less their reset's, and refuses zero rounds before it looks
    for a GPU."""
    from pagedstash_func.cli.bench import _stash as bench
    seconds = {"copy": [1.0, 1.0, 2.0], "stash": [2.0, 3.0, 5.0], "after stash": [1.0, 1.0, 1.0],
               "pop": [1.5, 1.5, 3.0], "after pop": [0.5, 0.5, 0.5],
               **{f"floor {s}": [1.0, 2.0, 4.0] for s in psf.kernels.FLOOR_SHAPES}}
    dst = torch.empty(4, 8, dtype=torch.bfloat16)
    row = bench._row(8, 4, 4, dst, seconds, 1e-6, True)
    # medians of 1, .5, .5 (stash) and of 1, 1, .8 (pop)
    assert row["stash_ratio"] == 1 / 2 and row["pop_ratio"] == 1.0
    assert row["floor"] == {s: 0.5 for s in psf.kernels.FLOOR_SHAPES}  # medians of 1, .5, .5
    assert row["copy_s"] == 1.0 and row["stash_gbs"] == row["copy_gbs"] / 2
    with pytest.raises(ValueError, match="rounds=0: pass 1 or more"):
        bench.bench_stash([8], [4], rounds=0)


def _scaled_loss(scale):
    def loss(params, batch):
        return loss_fn(params, batch) * scale
    return loss


def test_replay_knows_the_loss_by_what_it_computes_not_by_its_name(tmp_path):
    """Closures of one factory with other constants, two lambdas, two partials: each has the
    name of the other, and each is refused; the same function (or an equal rebuild) passes."""
    import functools
    params, batch = make(layers=1)
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=True, expert_ranks=2)
    cases = [(_scaled_loss(1.0), _scaled_loss(1000.0), _scaled_loss(1.0)),
             (lambda p, b: loss_fn(p, b), lambda p, b: 2 * loss_fn(p, b), None),
             (functools.partial(_scaled_loss(1.0)), functools.partial(_scaled_loss(3.0)),
              functools.partial(_scaled_loss(1.0)))]
    for i, (saved, other, equal) in enumerate(cases):
        step = psf.stash_aware(saved, cfg)
        path = tmp_path / f"{i}.pt"
        psf.save_step(path, step, params, batch, step.init(params, batch))
        with pytest.raises(ValueError, match="was saved with the loss"):
            psf.replay_step(path, other)
        for ok in (saved, equal):
            if ok is not None:
                assert torch.isfinite(psf.replay_step(path, ok).loss)


def test_a_loss_closing_over_an_arbitrary_object_is_refused_unless_unchecked(tmp_path):
    params, batch = make(layers=1)
    holder = object()

    def loss(p, b):
        assert holder is not None
        return loss_fn(p, b)

    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=1.25))
    with pytest.raises(ValueError, match=r"closure 'holder' is a builtins.object.*"
                                         r"check_loss_fn=False"):
        psf.save_step(tmp_path / "a.pt", step, params, batch, step.init(params, batch))
    psf.save_step(tmp_path / "a.pt", step, params, batch, step.init(params, batch),
                  check_loss_fn=False)
    with pytest.raises(ValueError, match="saved with check_loss_fn=False"):
        psf.replay_step(tmp_path / "a.pt", loss)
    assert torch.isfinite(psf.replay_step(tmp_path / "a.pt", loss, check_loss_fn=False).loss)


def test_a_from_hf_model_loss_is_known_by_its_model(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent.parent / "interop"))
    from hf_tiny import lm_batch, tiny_model
    params, loss = psf.from_hf_model(tiny_model("olmoe"))
    _, same = psf.from_hf_model(tiny_model("olmoe"))
    _, other = psf.from_hf_model(tiny_model("olmoe", layers=2))
    batch = lm_batch()
    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=1.25))
    path = tmp_path / "hf.pt"
    psf.save_step(path, step, params, batch, step.init(params, batch))
    assert torch.isfinite(psf.replay_step(path, same).loss)
    with pytest.raises(ValueError, match="was saved with the loss"):
        psf.replay_step(path, other)


SCALE = 1.0


def _global_scaled(params, batch):
    return loss_fn(params, batch) * SCALE


def test_a_changed_global_constant_is_another_loss_and_cycles_are_digested(tmp_path):
    global SCALE
    from pagedstash_func.step._identity import loss_identity
    params, batch = make(layers=1)
    step = psf.stash_aware(_global_scaled, psf.StashConfig(capacity_factor=1.25))
    path = tmp_path / "g.pt"
    psf.save_step(path, step, params, batch, step.init(params, batch))
    SCALE = 1000.0
    try:
        with pytest.raises(ValueError, match="was saved with the loss"):
            psf.replay_step(path, _global_scaled)
    finally:
        SCALE = 1.0
    assert torch.isfinite(psf.replay_step(path, _global_scaled).loss)
    cyclic = {"a": 1}
    cyclic["self"] = cyclic

    def loss(p, b):
        return loss_fn(p, b) * cyclic["a"]
    assert loss_identity(loss) == loss_identity(loss)


def test_common_loss_idioms_are_digested_and_a_1_element_loss_is_refused_at_once():
    from pagedstash_func.step._identity import loss_identity
    device = torch.device("cpu")

    def shifted(p, b):
        return loss_fn(p, {"x": b["x"][..., :, :].to(device)})
    assert loss_identity(shifted) == loss_identity(shifted)

    class Box:
        def __init__(self, v):
            self.v = v

        def __psf_identity__(self):
            return [self.v]

    def two(a, b):
        return lambda p, batch: loss_fn(p, batch) * a.v * b.v
    assert loss_identity(two(Box(1.0), Box(2.0))) != loss_identity(two(Box(1.0), Box(3.0)))
    params, batch = make(layers=1)
    step = psf.stash_aware(lambda p, b: loss_fn(p, b).reshape(1), psf.StashConfig())
    with pytest.raises(ValueError, match=r"0-d scalar tensor loss.*loss.squeeze\(\)"):
        step.init(params, batch)


def test_a_state_of_another_rank_count_or_shape_names_what_differs_and_the_fix():
    params, batch = make(layers=1)
    state = stepper(expert_ranks=2).init(params, batch)
    with pytest.raises(psf.StateMismatchError, match="runs over expert_ranks=4 virtual ranks, "
                                                     "but its state was built for "
                                                     "expert_ranks=2"):
        psf.run_step(stepper(expert_ranks=4), params, batch, state)
    state = stepper().init(params, batch)
    with pytest.raises(psf.StateMismatchError, match=r"tokens 16 \(state: 32\).*"
                                                     r"psf.pad_to_bucket.*psf.pad_rows"):
        psf.run_step(stepper(), params, {"x": batch["x"][:16]}, state)


def test_a_loss_without_psf_moe_is_refused_when_the_state_is_built():
    params, batch = make(layers=1)
    with pytest.raises(ValueError, match="the loss calls psf.moe nowhere.*psf.value_and_grad"):
        stepper(fn=lambda p, b: (b["x"] @ p[0]["router"].T).square().mean()).init(params, batch)


def test_grad_of_a_step_without_has_aux_says_what_the_step_returns():
    params, batch = make(layers=1)
    step = stepper()
    state = step.init(params, batch)
    for transform in (torch.func.grad, torch.func.grad_and_value):
        with pytest.raises(ValueError, match=r"returns \(loss, state\).*has_aux=True"):
            transform(step)(params, batch, state)
    grads, state = torch.func.grad(step, has_aux=True)(params, batch, state)   # still usable
    assert set(grads[0]) == set(params[0]) and not state.consumed


def test_a_batch_on_another_device_than_the_params_is_named():
    params, batch = make(layers=1)
    step = stepper()
    state = step.init(params, batch)
    with pytest.raises(ValueError, match=r"batch\['x'\] is on meta and the params on cpu"):
        psf.run_step(step, params, {"x": batch["x"].to("meta")}, state)
    assert not psf.run_step(step, params, batch, psf.reset(state)).report.reran
