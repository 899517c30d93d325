"""On CUDA only: a whole transformers model through psf syncs nowhere in a capacity attempt,
a graph-replayed or compiled whole-model step equals eager run_step, the offloaded optimizer
steps it as the device's does, and bench train reports where an offloaded step goes."""

import pytest
import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

pytest.importorskip("transformers")
from hf_tiny import lm_batch, tiny_model  # noqa: E402
from sync_free import without_sync  # noqa: E402

pytestmark = pytest.mark.gpu


def cuda_model(family="qwen3_moe", prepared_mask=False):
    model = tiny_model(family, layers=3, experts=8).to("cuda", torch.bfloat16)
    batch = {k: v.cuda() for k, v in lm_batch(batch=4, seq=32, pad_from=24).items()}
    if prepared_mask:      # transformers takes a 4-D mask as it is, with no host read
        causal = torch.ones(32, 32, dtype=torch.bool, device="cuda").tril()
        batch["attention_mask"] = causal & batch["attention_mask"].bool()[:, None, None, :]
    return model, batch


@pytest.mark.parametrize("stash,mask", [(False, "4d"), (True, "4d"), (True, None)])
def test_a_whole_model_capacity_attempt_does_not_sync(stash, mask):
    """With a prepared 4-D mask, or with no mask at all (transformers' look for packed
    sequences in its own position ids is answered without reading the device)."""
    model, batch = cuda_model(prepared_mask=True)
    params, loss_fn = psf.from_hf_model(model)
    padded = {**batch, "attention_mask": batch["attention_mask"][:, 0].diagonal(dim1=1, dim2=2)}
    torch.testing.assert_close(loss_fn(params, batch)[0], loss_fn(params, padded)[0])
    if mask is None:
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        batch["labels"] = batch["input_ids"].clone()
        torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss.float(),
                                   rtol=2e-2, atol=0)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=stash))
    state = step.init(params, batch)
    attempt = psf.value_and_grad(step.attempt, has_aux=True)
    attempt(params, batch, state.clone())          # warm up (kernels compile, handles)
    grads, (loss, (aux, new)) = without_sync(attempt, params, batch, state)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("family,mask", [("qwen3_moe", "4d"), ("olmoe", "4d"),
                                         ("mixtral", "4d"), ("qwen3_moe", None),
                                         ("qwen2_moe", "4d"), ("deepseek_v3", None)])
def test_graph_replay_of_a_whole_model_step_equals_eager(family, mask):
    torch.use_deterministic_algorithms(True)
    try:
        model, batch = cuda_model(family, prepared_mask=True)
        if mask is None:
            batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"].clone()}
        params, loss_fn = psf.from_hf_model(model)
        step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=True))
        gstep = psf.graphed(step)
        g_state = step.init(params, batch)
        e_state = g_state.clone()
        for i in range(3):
            b = {**batch, "input_ids": batch["input_ids"].roll(i, 1)}
            g = gstep(params, b, g_state)
            e = psf.run_step(step, params, b, e_state)
            # the same attention kernels captured or not (causal without a mask: the loss
            # keeps transformers from building one under capture), so the same bits
            assert torch.equal(g.loss, e.loss), (i, g.loss, e.loss)
            for x, y in zip(pytree.tree_leaves(g.grads), pytree.tree_leaves(e.grads)):
                assert torch.equal(x, y), i
            g_state, e_state = g.state, e.state
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_compiled_whole_model_step_equals_eager_and_does_not_sync(family):
    """psf.compile (Inductor) over a bf16 whole-model step with the stash: the eager step's
    routing, loads and reruns, its loss and gradients to bf16's precision (Inductor fuses the
    elementwise ops around the kernels), and an attempt plus backward with no host sync."""
    torch._dynamo.reset()
    model, batch = cuda_model(family, prepared_mask=True)
    params, loss_fn = psf.from_hf_model(model)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=True,
                                                    pool_scope="layer", cuda_factor=0.9))
    compiled = psf.compile(step)
    a = psf.run_step(compiled, params, batch, compiled.init(params, batch))
    b = psf.run_step(step, params, batch, step.init(params, batch))
    assert a.report.reran == b.report.reran
    assert [r.expert_load for r in a.report.layers] == [r.expert_load for r in b.report.layers]
    torch.testing.assert_close(a.loss, b.loss, rtol=2e-2, atol=1e-3)
    for x, y in zip(pytree.tree_leaves(a.grads), pytree.tree_leaves(b.grads)):
        assert ((x.float() - y.float()).abs().max() /
                y.float().abs().max().clamp_min(1e-6)) < 5e-2
    params = pytree.tree_map(lambda t: t.detach().requires_grad_(), params)   # differentiate
    leaves, state = pytree.tree_leaves(params), compiled.init(params, batch)
    for sync_mode in (0, 0, "error"):       # compiled for these params, run, then watched
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            loss, (_, state) = compiled.attempt(params, batch, state)
            torch.autograd.grad(loss, leaves, allow_unused=True)   # a bias is not trained
            state, _ = psf.reclaim(state)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_a_captured_compiled_whole_model_step_equals_the_compiled_step(family):
    """psf.graphed over psf.compile, a whole bf16 model with the stash: one CUDA graph of the
    compiled forward and backward, bit-equal to the uncaptured compiled step over steps whose
    batches change (deterministic mode), routing and loads included; its loss the eager
    step's to bf16 precision."""
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(True)
    try:
        model, batch = cuda_model(family, prepared_mask=True)
        params, loss_fn = psf.from_hf_model(model)
        step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=True,
                                                        pool_scope="layer"))
        compiled = psf.compile(step)
        gstep = psf.graphed(compiled)
        states = [compiled.init(params, batch) for _ in range(3)]
        for i in range(3):
            b = {**batch, "input_ids": batch["input_ids"].roll(i, 1)}
            g = gstep(params, b, states[0])
            c = psf.run_step(compiled, params, b, states[1])
            e = psf.run_step(step, params, b, states[2])
            states = [g.state, c.state, e.state]
            assert torch.equal(g.loss, c.loss), (i, g.loss, c.loss)
            for x, y in zip(pytree.tree_leaves(g.grads), pytree.tree_leaves(c.grads)):
                assert torch.equal(x, y), i
            assert g.report.reran == c.report.reran == e.report.reran
            assert [r.expert_load for r in g.report.layers] == \
                [r.expert_load for r in c.report.layers]
            # eager rounds bf16 per op where the compiler fuses: a router deeper in the model
            # may send a token elsewhere, so against eager only the loss is compared
            torch.testing.assert_close(g.loss, e.loss, rtol=2e-2, atol=1e-3)
        assert gstep.captures == 1
    finally:
        torch.use_deterministic_algorithms(False)


def test_an_offloaded_optimizer_steps_a_whole_model_as_the_device_one_does(monkeypatch):
    """The state on the host (pinned slots, side stream, fused CPU AdamW) against the same
    optimizer on the GPU (fused CUDA AdamW) given the same gradients, bf16 weights, 5 steps of
    run_step with clipping: the same weights to bf16 rounding (the two fused kernels round fp32
    differently; from gradients of their own, AdamW's first steps would turn a rounding in a
    near-zero gradient into a whole step of lr), and the caller's stream reads the weights only
    after the last copy up."""
    import pagedstash_func.parallel._offload as offload
    import pagedstash_func.parallel._zero as zero
    monkeypatch.setattr(zero, "BUCKET_BYTES", 4 * 4096)    # many buckets: the slots turn over
    receive = offload.HostSteps._receive

    def late(self, b, i):           # each copy up held back on the side stream (~10 ms)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(20_000_000)
        receive(self, b, i)
    monkeypatch.setattr(offload.HostSteps, "_receive", late)
    model, batch = cuda_model("qwen3_moe", prepared_mask=True)
    params, loss_fn = psf.from_hf_model(model)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=True))
    other = pytree.tree_map(torch.clone, params)
    kw = dict(lr=1e-3, weight_decay=0.01, max_norm=1.0)
    host = psf.sharded_optimizer(params, None, offload=True, **kw)
    device = psf.sharded_optimizer(other, None, fused=True, **kw)
    assert len(host.buckets) > 4 and host.buckets[0].master.device.type == "cpu"
    assert host.pinned_bytes() == psf.plan_memory(model, 128, offload=True).pinned_host
    state = step.init(params, batch)
    start = [t.clone() for t in pytree.tree_leaves(params)]
    for _ in range(5):
        res = psf.run_step(step, params, batch, state)
        state = res.state
        grads = pytree.tree_map(torch.clone, res.grads)
        host.step(params, res.grads)
        seen = [t.clone() for t in pytree.tree_leaves(params)]   # the caller's stream, at once:
        # without its wait for the side stream these would read the weights not yet written
        device.step(other, grads)                # the same gradients: only the optimizers differ
        torch.cuda.synchronize()
        for a, b in zip(seen, pytree.tree_leaves(params)):       # no write was still on its way
            assert torch.equal(a, b)
    for a, b in zip(pytree.tree_leaves(params), pytree.tree_leaves(other)):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(pytree.tree_leaves(params), start))
    times = host.offload_times()     # copies up held back on the side stream: the host
    # waited for their slots
    assert times["to_host"] > 0 and times["to_device"] > 0 and times["optimizer"] > 0
    assert times["wait"] > 0.01 and times["wall"] >= times["wait"] + times["optimizer"]


def test_bench_train_says_where_an_offloaded_step_goes(capsys):
    """`bench train --optimizer adamw-offload --plan` at a small shape: each path's gradients
    and optimizer time, the host's parts and the copies, the state's bytes (12 a parameter,
    in host memory) and the plan beside the measured peak."""
    from pagedstash_func.cli.bench._train import bench_train, hf_config, shape_of
    widths = dict(hidden=256, experts=8, ffn=128, top_k=2, vocab=1024, heads=4, kv_heads=4,
                  head_dim=64)
    rows = bench_train(model="olmoe", layers=2, tokens=512, seq=256,
                       paths=("stash-layer", "exact"), optimizer="adamw-offload", iters=2,
                       warmup=1, shape_overrides=widths, plan=True)
    out = capsys.readouterr().out
    for path in ("stash-layer", "exact"):
        r = rows[path]
        assert r["offloaded"] and r["pinned_bytes"] > 0
        split = r["split"]
        assert split["grads"] > 0 and split["optimizer"] > 0
        assert split["host_to_host"] > 0 and split["host_to_device"] > 0
        assert split["host_optimizer"] <= split["host_wall"]
    shape = shape_of("olmoe", layers=2, tokens=512, seq=256, **widths)
    plan = psf.plan_memory(hf_config(shape), 512, optimizer="adamw", offload=True)
    for r in rows.values():                    # the host's state and slots as planned
        assert (r["state_bytes"], r["pinned_bytes"]) == (plan.host, plan.pinned_host)
    assert "where it goes" in out and "overlap" in out and "plan/measured" in out
    assert "in host memory" in out
