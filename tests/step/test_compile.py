"""torch.compile over a capacity attempt: it traces whole (no graph break) with and without
the stash, forward and backward, and gives the eager step's numbers through `run_step`, with
drops, overflows and reruns; the pages' host-side checks (a second backward, a consumed state,
a backward after reclaim) still refuse when compiled; what cannot be compiled right is refused
by psf's own message."""

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_leaves

import pagedstash_func as psf
from pagedstash_func.step._runner import attempt_step

E, H, F, K, T = 8, 16, 24, 2, 32


def _setup(cf, stash, **cfg):
    g = torch.Generator().manual_seed(0)
    params = [{k: v.requires_grad_() for k, v in psf.moe_init(E, H, F, generator=g).items()}
              for _ in range(2)]
    batch = {"x": torch.randn(T, H, generator=g), "pad": torch.arange(T) >= T // 2}

    def loss_fn(params, batch):     # the second half of the tokens is padding
        x = batch["x"]
        for p in params:
            h = torch.tanh(x)
            ids, weights = psf.route(p["router"], h, K)
            ids = ids.masked_fill(batch["pad"][:, None], -1)
            x = x + psf.moe(p, h, top_k=K, routing=(ids, weights))
        return x.square().mean()
    cfg = {"pool_scope": "layer", **cfg} if stash else cfg     # what psf.compile stashes into
    cfg = psf.StashConfig(capacity_factor=cf, paged_stash=stash, page_size=8, expert_ranks=2,
                          **cfg)
    return params, batch, psf.stash_aware(loss_fn, cfg)


def _leaves(params):
    return [v for p in params for v in p.values()]


def _run(attempt, params, batch, step):
    loss, state = attempt(params, batch, step.init(params, batch))
    return loss, torch.autograd.grad(loss, _leaves(params)), state


def _assert_close(compiled, eager):
    # the grouped matmul traces as one batched product a row (eager loops over groups on
    # the CPU): the same sums in another order, so fp32 rounding apart
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-7)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class _Graphs:
    """A backend that keeps the forward and backward graphs AOTAutograd makes, split as
    Inductor splits them (the min-cut partitioner, which computes in the forward whatever
    needs no gradient and cannot be recomputed)."""

    def __init__(self):
        self.forward, self.backward = [], []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward),
                                    bw_compiler=self._keep(self.backward),
                                    partition_fn=min_cut_rematerialization_partition)

    @staticmethod
    def _keep(into):
        def compiler(gm, example_inputs):
            into.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    @staticmethod
    def ops(graphs) -> list:
        """Every op the graphs call, once per call (a mutating op by its own name)."""
        return [str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
                for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("cf", [2.0, 0.5])          # 0.5: pairs dropped, over_budget raised
def test_a_capacity_attempt_without_the_stash_traces_whole_and_equals_eager(cf):
    torch._dynamo.reset()
    params, batch, step = _setup(cf, stash=False)
    state = step.init(params, batch)
    explained = torch._dynamo.explain(step.attempt)(params, batch, state)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    eager = _run(step.attempt, params, batch, step)
    compiled = _run(torch.compile(step.attempt, fullgraph=True, backend="aot_eager"),
                    params, batch, step)
    _assert_close(compiled, eager)
    assert torch.equal(compiled[2].flags, eager[2].flags)
    assert bool(eager[2].flags[2]) == (cf < 1)                   # over_budget
    for name, count in eager[2].counts.items():
        assert torch.equal(compiled[2].counts[name], count), name


@pytest.mark.parametrize("precision,factor,paged", [
    ("same", 0.75, "swiglu"), ("fp8", 0.75, "copy"),
    ("same", 1.0, None),       # its own pool would be no smaller than the buffer: kept whole
])
def test_a_stashing_attempt_traces_whole_with_the_pages_in_both_graphs(precision, factor,
                                                                        paged):
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=factor,
                                 stash_precision=precision)
    compiled = psf.compile(step, backend="aot_eager")
    explained = torch._dynamo.explain(compiled._body)(params, batch, step.init(params, batch),
                                                        True)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    graphs = _Graphs()
    traced = psf.compile(step, backend=graphs.backend)
    loss, state = traced.attempt(params, batch, step.init(params, batch))
    eager_loss, eager_state = step.attempt(params, batch, step.init(params, batch))
    out = loss, torch.autograd.grad(loss, _leaves(params)), state
    forward, backward = (sorted(o for o in _Graphs.ops(g) if o.startswith("pagedstash"))
                         for g in (graphs.forward, graphs.backward))
    # (the release of a page table and pool of the call's own changes nothing that outlives
    # the graph, so the compiler drops it; the pool goes after its last reader)
    page_ops = {"swiglu": ({"stash_reserve", "swiglu_forward_stash"},
                           {"swiglu_backward_paged"}),
                "copy": ({"stash_copy"}, {"stash_pop"}),   # float8 rows copied, popped
                None: (set(), set())}[paged]
    assert {f"pagedstash_func.{op}.default" for op in page_ops[0]} <= set(forward), forward
    assert {f"pagedstash_func.{op}.default" for op in page_ops[1]} <= set(backward), backward
    if paged is None:
        assert not [o for o in forward + backward if ".stash_" in o], (forward, backward)
    # backward gathers each layer's fc1 input again from x (beside the gradient's rows), not
    # the forward's [C, H] rows saved
    assert backward.count("pagedstash_func.gather_rows.default") == 2 * len(params), backward
    eager = eager_loss, torch.autograd.grad(eager_loss, _leaves(params)), eager_state
    _assert_close(out, eager)
    assert torch.equal(out[2].flags, eager[2].flags)
    assert psf.pages_in_use(out[2]) == psf.pages_in_use(eager[2])      # every page back
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(out[2]).values())


def _same_result(a, b, exact: bool):
    assert a.report.reran == b.report.reran and a.report.reasons == b.report.reasons
    assert a.report.pages_needed == b.report.pages_needed
    assert [r.expert_load for r in a.report.layers] == [r.expert_load for r in b.report.layers]
    pairs = list(zip(tree_leaves(a.grads), tree_leaves(b.grads)))
    if exact:                  # both reran on the same (eager) exact path
        assert torch.equal(a.loss, b.loss)
        assert all(torch.equal(x, y) for x, y in pairs)
    else:
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
        for x, y in pairs:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", ["fits", "over_budget", "overflow"])
def test_compiled_run_step_equals_eager_with_drops_overflow_and_reruns(case):
    torch._dynamo.reset()
    cf = {"fits": 2.0, "over_budget": 0.5, "overflow": 2.0}[case]
    extra = {"cuda_factor": 0.25 if case == "overflow" else 0.75}
    params, batch, step = _setup(cf, stash=True, **extra)
    compiled = psf.compile(step, backend="aot_eager")
    eager_state, compiled_state = step.init(params, batch), compiled.init(params, batch)
    for _ in range(2):
        a = psf.run_step(compiled, params, batch, compiled_state)
        b = psf.run_step(step, params, batch, eager_state)
        compiled_state, eager_state = a.state, b.state
        assert a.report.reran == (case != "fits")
        assert a.report.overflow == (case == "overflow")
        _same_result(a, b, exact=case != "fits")
    # the attempt itself, dropped pairs and all (no rerun): the same gradients
    a = attempt_step(compiled, params, batch, compiled_state, rerun=False)
    b = attempt_step(step, params, batch, eager_state, rerun=False)
    _same_result(a, b, exact=False)


def test_the_raw_loop_compiles_once():
    """attempt, backward, reclaim, again: the records of stashes whose pages are back do not
    change what the compiler sees from one step to the next."""
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=0.75)
    compiled = psf.compile(step, backend="aot_eager")
    state = compiled.init(params, batch)
    for i in range(4):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss, state = compiled.attempt(params, batch, state)
        torch.autograd.grad(loss, _leaves(params))
        state, released = psf.reclaim(state)
        assert released == ()


def test_no_recompile_and_no_fallback_over_20_steps():
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=0.75)
    compiled = psf.compile(step, backend="aot_eager")
    state = compiled.init(params, batch)
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(20):
            res = psf.run_step(compiled, params, batch, state)
            state = res.state
            assert not res.report.reran and not res.report.unconsumed
    assert counters["stats"]["unique_graphs"] - before == 1


def test_two_compiled_steps_of_other_factors_in_one_process():
    """A train and an eval step (two capacity factors) compile apart: each compiled step
    traces code of its own, with static shapes, so the second is not made dynamic."""
    torch._dynamo.reset()
    params, batch, step = _setup(1.25, stash=True, cuda_factor=0.75)
    other = psf.stash_aware(step.loss_fn, psf.StashConfig(capacity_factor=2.0, expert_ranks=2))
    for s in (step, other, step):
        compiled = psf.compile(s, backend="aot_eager")
        a = psf.run_step(compiled, params, batch, compiled.init(params, batch))
        b = psf.run_step(s, params, batch, s.init(params, batch))
        _same_result(a, b, exact=a.report.reran)


def test_a_non_finite_token_reaches_the_same_gradients_compiled():
    """A NaN row stays in the experts its token reached, as eager keeps it (the static grouped
    matmuls of a traced step never multiply another group's rows, even by zero)."""
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=0.75)
    batch["x"][3] = float("nan")
    compiled = psf.compile(step, backend="aot_eager")
    a = attempt_step(compiled, params, batch, compiled.init(params, batch), rerun=False)
    b = attempt_step(step, params, batch, step.init(params, batch), rerun=False)
    for x, y in zip(tree_leaves(a.grads), tree_leaves(b.grads)):
        assert torch.equal(x.isfinite(), y.isfinite())
        torch.testing.assert_close(x.nan_to_num(), y.nan_to_num(), rtol=1e-5, atol=1e-7)
    partly = [y.isfinite().float().mean().item() for y in tree_leaves(b.grads)]
    assert any(0 < f < 1 for f in partly), partly      # some experts' NaN, others' not


def test_compiled_page_checks_still_refuse():
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=0.75)
    compiled = psf.compile(step, backend="aot_eager")
    state = compiled.init(params, batch)
    loss, new_state = compiled.attempt(params, batch, state)
    with pytest.raises(psf.ConsumedStateError):
        compiled.attempt(params, batch, state)
    torch.autograd.grad(loss, _leaves(params))
    with pytest.raises(RuntimeError, match="a second backward through moe0"):
        torch.autograd.grad(loss, _leaves(params))
    with pytest.raises(psf.StateMismatchError, match="tokens 16"):   # psf's own, not Dynamo's
        compiled.attempt(params, {k: v[:16] for k, v in batch.items()}, new_state)
    assert not new_state.consumed       # a step refused while traced leaves its state
    loss, held = compiled.attempt(params, batch, new_state)      # its backward not run yet
    with pytest.raises(ValueError, match="moe0 still holds the pages"):
        compiled.attempt(params, batch, held)
    with pytest.raises(ValueError, match="torch.Generator in the batch"):
        compiled.attempt(params, {**batch, "g": torch.Generator()}, held)
    with pytest.raises(TypeError, match="not a step"):
        psf.adaptive(compiled, step.cfg)
    # a backward after the pages were reclaimed
    later, released = psf.reclaim(held)
    assert released == ("moe0", "moe1")
    loss, later = compiled.attempt(params, batch, later)
    later, released = psf.reclaim(later)
    assert released == ("moe0", "moe1")
    with pytest.raises(RuntimeError, match="after its stashed pages were reclaimed"):
        torch.autograd.grad(loss, _leaves(params))


def test_a_retained_graph_cannot_read_the_pages_twice():
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=0.75)
    # AOTAutograd refuses retain_graph=True where it donated the saved buffers; without
    # donation the compiled backward could run twice, and the second is psf's to refuse
    with torch._functorch.config.patch(donated_buffer=False):
        compiled = psf.compile(step, backend="aot_eager")
        loss, _ = compiled.attempt(params, batch, compiled.init(params, batch))
        torch.autograd.grad(loss, _leaves(params), retain_graph=True)
        with pytest.raises(RuntimeError, match="a second backward through moe0"):
            torch.autograd.grad(loss, _leaves(params))


def test_a_backend_psf_cannot_guard_is_refused():
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=0.75)
    with pytest.raises(ValueError, match="does not go through AOTAutograd"):
        psf.compile(step, backend="eager")
    compiled = psf.compile(step, backend=lambda gm, inputs: gm.forward)    # found at its call
    with pytest.raises(RuntimeError, match="does not go through AOTAutograd"):
        compiled.attempt(params, batch, compiled.init(params, batch))


@pytest.mark.parametrize("stash", [False, True])
def test_a_second_derivative_through_a_compiled_step_is_refused(stash):
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=stash, **({"cuda_factor": 0.75} if stash else {}))
    compiled = psf.compile(step, backend="aot_eager")
    loss, _ = compiled.attempt(params, batch, compiled.init(params, batch))
    with pytest.raises(RuntimeError, match="a second derivative"):
        torch.autograd.grad(loss, _leaves(params), create_graph=True)


def test_what_cannot_compile_right_is_refused_by_psf():
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True, cuda_factor=0.75)
    for fullgraph in (True, False):     # refused whole, or in the eager fallback
        with pytest.raises(Exception, match=r"compile it with psf.compile\(step\)"):
            torch.compile(step.attempt, fullgraph=fullgraph, backend="aot_eager")(
                params, batch, step.init(params, batch))
    compiled = psf.compile(step, backend="aot_eager")
    with pytest.raises(NotImplementedError, match="under torch.compile"):
        torch.func.grad_and_value(compiled, has_aux=True)(params, batch,
                                                          compiled.init(params, batch))
    for fn in (step, step.attempt):
        torch._dynamo.reset()
        with pytest.raises(NotImplementedError, match="under torch.compile"):
            torch.compile(torch.func.grad_and_value(fn, has_aux=True), backend="aot_eager")(
                params, batch, step.init(params, batch))
    with pytest.raises(TypeError, match="psf.stash_aware"):
        psf.compile(lambda p, b, s: 0)
    with pytest.raises(TypeError, match=r"psf.compile of one"):     # torch.compile(step)
        psf.run_step(torch.compile(step), params, batch, step.init(params, batch))
    with pytest.raises(TypeError, match="compiled already"):
        psf.compile(compiled)
    shared = psf.stash_aware(step.loss_fn, psf.StashConfig(capacity_factor=2.0, paged_stash=True))
    with pytest.raises(ValueError, match="pool_scope='layer'"):
        psf.compile(shared)


def test_compiled_evaluation_without_gradients_and_refused_transforms():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    p = psf.moe_init(E, H, F, generator=g)
    x = torch.randn(T, H, generator=g)
    with torch.no_grad():
        out = torch.compile(lambda p, x: psf.moe(p, x, top_k=K), backend="aot_eager")(p, x)
    torch.testing.assert_close(out, psf.moe(p, x, top_k=K), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="psf.moe does not support vmap"):
        torch.func.vmap(lambda x: psf.moe(p, x, top_k=K))(torch.randn(2, T, H))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: psf.moe(p, x, top_k=K), (x,), (x,))
    import torch.autograd.forward_ad as fwad
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        psf.moe(p, fwad.make_dual(x, torch.ones_like(x)), top_k=K)


def test_compiled_micro_batches_and_a_new_bucket_compile_once_each():
    """run_micro_batches over a compiled step equals it over the eager one; a batch of
    another size (another bucket, with a state of its own) compiles once, then no more."""
    torch._dynamo.reset()
    params, batch, step = _setup(0.75, stash=True, cuda_factor=0.75)
    compiled = psf.compile(step, backend="aot_eager")
    g = torch.Generator().manual_seed(5)
    micro = [{"x": torch.randn(T, H, generator=g), "pad": batch["pad"]} for _ in range(3)]
    small = [{"x": b["x"][:16], "pad": b["pad"][:16]} for b in micro]
    for i, batches in enumerate((micro, small, micro, small)):
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):   # both sizes compiled
            a = psf.run_micro_batches(compiled, params, batches,
                                      compiled.init(params, batches[0]))
        b = psf.run_micro_batches(step, params, batches, step.init(params, batches[0]))
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
        for x, y in zip(tree_leaves(a.grads), tree_leaves(b.grads)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
