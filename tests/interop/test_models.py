"""`from_hf_model` / `to_hf_state_dict`: whole transformers MoE causal LMs through psf.moe,
held to transformers' own forward and backward (fp32)."""

import pytest
import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

pytest.importorskip("transformers")
from hf_tiny import FAMILIES, lm_batch, tiny_model  # noqa: E402


def hf_loss_and_grads(model, batch):
    """transformers' own loss and gradients, by parameter name."""
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def assert_close_to_hf(loss, grads_sd, ref_loss, ref_grads):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-12)
        err = (grads_sd[name] - ref).abs().max() / scale
        assert err < 1e-4, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("chunk", [0, 5, None])     # automatic, 5 rows, transformers' head
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_every_gradient_equal_transformers(family, masked, chunk):
    model = tiny_model(family)
    batch = lm_batch(pad_from=7 if masked else None)
    ref_loss, ref_grads = hf_loss_and_grads(model, batch)
    params, loss_fn = psf.from_hf_model(model, loss_chunk=chunk)
    grads, (loss, aux) = psf.value_and_grad(loss_fn, has_aux=True)(params, batch)
    assert_close_to_hf(loss, psf.to_hf_state_dict(grads, model), ref_loss, ref_grads)
    assert int(aux["tokens"]) == int((batch["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("cf, reruns, stash, family", [
    (0.5, True, False, "qwen3_moe"), (4.0, False, False, "qwen3_moe"),
    (0.5, True, True, "qwen3_moe"), (4.0, False, True, "qwen3_moe"),
    (0.5, True, True, "qwen2_moe"), (0.5, True, True, "deepseek_v3"),
    (4.0, False, True, "deepseek_v3")])
def test_run_step_on_the_whole_model_equals_transformers(cf, reruns, stash, family):
    model = tiny_model(family)
    batch = lm_batch(batch=2, seq=24, pad_from=17)
    ref_loss, ref_grads = hf_loss_and_grads(model, batch)
    params, loss_fn = psf.from_hf_model(model)
    exact_grads, (exact_loss, _) = psf.value_and_grad(loss_fn, has_aux=True)(params, batch)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=cf, expert_ranks=4,
                                                    paged_stash=stash))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.reran is reruns
    assert_close_to_hf(res.loss, psf.to_hf_state_dict(res.grads, model), ref_loss, ref_grads)
    if reruns:      # the rerun is the exact path: its bits
        for a, b in zip(pytree.tree_leaves(res.grads), pytree.tree_leaves(exact_grads)):
            assert torch.equal(a, b)
    padded = sum(1 - batch["attention_mask"].reshape(-1)).item()
    for layer in res.report.layers:   # masked tokens reach no expert
        assert sum(layer.expert_load) == (48 - padded) * 2
    assert len(res.report.layers) == len(loss_fn.blocks)


@pytest.mark.parametrize("cf", [None, 0.5])
def test_lean_gradients_equal_torch_func_bit_for_bit(cf):
    model = tiny_model("mixtral")
    batch = lm_batch(seq=24, pad_from=20)
    params, loss_fn = psf.from_hf_model(model)
    cfg = psf.StashConfig(capacity_factor=cf, expert_ranks=4, paged_stash=cf is not None)
    step = psf.stash_aware(loss_fn, cfg)
    ours = psf.value_and_grad(step, has_aux=True)(params, batch, step.init(params, batch))
    theirs = torch.func.grad_and_value(step, has_aux=True)(params, batch,
                                                           step.init(params, batch))
    (g1, (l1, (a1, s1))), (g2, (l2, (a2, s2))) = ours, theirs
    if cf is not None:
        assert psf.read_flags(s1)["over_budget"]            # the attempt dropped pairs
    for a, b in zip(pytree.tree_leaves((g1, l1, a1)), pytree.tree_leaves((g2, l2, a2))):
        assert torch.equal(a, b)


def test_one_copy_of_every_tensor_and_the_model_still_runs():
    model = tiny_model("olmoe")
    batch = lm_batch()
    before = model(**batch).loss.detach()
    params, _ = psf.from_hf_model(model)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for leaf in pytree.tree_leaves(params):
        assert leaf.untyped_storage().data_ptr() in storages
    assert len(storages) == len(list(model.parameters()))        # no second copy anywhere
    torch.testing.assert_close(model(**batch).loss.detach(), before, rtol=0, atol=0)
    assert all(leaf.is_floating_point() for leaf in pytree.tree_leaves(params))
    assert set(params["model.layers.0.mlp"]) == {"router", "w_gate_up", "w_down"}


def test_state_dict_round_trip_through_load_state_dict(tmp_path):
    model = tiny_model("mixtral")
    params, _ = psf.from_hf_model(model)
    new = pytree.tree_map(lambda t: t + 0.5, params)
    model.load_state_dict(psf.to_hf_state_dict(new, model))
    back = psf.to_hf_state_dict(params, model)     # params alias the model: now the new values
    for name, t in psf.to_hf_state_dict(new, model).items():
        assert torch.equal(back[name], t), name
    model.save_pretrained(tmp_path)
    import transformers
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, t in again.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]), name


def test_adamw_through_run_step_lowers_the_loss():
    model = tiny_model("qwen3_moe")
    batch = lm_batch(batch=4, seq=16)
    params, loss_fn = psf.from_hf_model(model)
    leaves = pytree.tree_leaves(params)
    opt = torch.optim.AdamW(leaves, lr=3e-3)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=True))
    state = step.init(params, batch)
    losses = []
    for _ in range(15):
        res = psf.run_step(step, params, batch, state)
        state = res.state
        for p, g in zip(leaves, pytree.tree_leaves(res.grads)):
            p.grad = g
        opt.step()
        losses.append(res.loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    torch.testing.assert_close(model(**batch).loss.detach(), loss_fn(params, batch)[0].detach())


def test_an_unsupported_family_is_refused_by_name():
    import transformers
    cfg = transformers.GraniteMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2)
    with pytest.raises(ValueError, match="'granitemoe'.*its own normalisation"):
        psf.from_hf_model(transformers.AutoModelForCausalLM.from_config(cfg))
    with pytest.raises(TypeError, match="needs a transformers model"):
        psf.from_hf_model({"not": "a model"})


def test_settings_psf_does_not_compute_are_refused():
    model = tiny_model("qwen3_moe")
    model.config.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        psf.from_hf_model(model)


@pytest.mark.parametrize("where", ["label", "next label"])
def test_masked_positions_that_feed_the_loss_are_refused(where):
    model = tiny_model("olmoe")
    batch = lm_batch(seq=16, pad_from=10)
    if where == "label":                           # the first masked position: this rule only
        batch["labels"][-1, 10] = 5
    else:                                          # left padding: the first real token's label
        batch["attention_mask"][0, :3] = 0
        batch["labels"][0, :3] = -100
    params, loss_fn = psf.from_hf_model(model)
    with pytest.raises(ValueError, match="masked by attention_mask but feeds the loss"):
        loss_fn(params, batch)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.0))
    with pytest.raises(ValueError, match="masked by attention_mask but feeds the loss"):
        step.init(params, batch)
    # on the capacity path the check costs no host read: the runner's one flag read raises it
    good = lm_batch(seq=16, pad_from=10)
    state = step.init(params, good)
    with pytest.raises(ValueError, match="masked by attention_mask but feeds the loss"):
        psf.run_step(step, params, batch, state)


def test_bad_batches_and_trees_name_the_fix():
    model = tiny_model("mixtral")
    params, loss_fn = psf.from_hf_model(model)
    with pytest.raises(ValueError, match=r"missing \['labels'\]"):
        loss_fn(params, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \[1, 3\]"):
        loss_fn(params, {"input_ids": torch.zeros(1, 4, dtype=torch.long),
                         "labels": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="must hold router, w_gate_up and w_down"):
        psf.to_hf_state_dict({**params, "model.layers.0.mlp": {}}, model)
    with pytest.raises(ValueError, match="lacks"):
        psf.to_hf_state_dict({k: v for k, v in params.items() if "embed" not in k}, model)


def test_a_block_snapshot_inside_a_differentiated_loss_is_refused():
    model = tiny_model("mixtral")
    block = model.model.layers[0].mlp
    x = torch.randn(6, 32)

    def loss(params, x):
        return psf.moe(psf.from_hf_moe_block(block), x, top_k=2).sum()

    with pytest.raises(ValueError, match="from_hf_model"):
        torch.func.grad(loss)({}, x)
    step = psf.stash_aware(lambda p, b: loss(p, b), psf.StashConfig())
    with pytest.raises(ValueError, match="from_hf_model"):
        step.init({}, x)
    assert set(psf.from_hf_moe_block(block)) == {"router", "w_gate_up", "w_down"}   # outside: ok


def test_a_prepared_4d_mask_routes_and_loses_like_the_2d_one():
    model = tiny_model("qwen3_moe")
    batch = lm_batch(seq=12, pad_from=8)
    params, loss_fn = psf.from_hf_model(model)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    prepared = {**batch, "attention_mask": causal & batch["attention_mask"].bool()[:, None, None]}
    g1, (l1, _) = psf.value_and_grad(loss_fn, has_aux=True)(params, batch)
    g2, (l2, _) = psf.value_and_grad(loss_fn, has_aux=True)(params, prepared)
    torch.testing.assert_close(l1, l2)
    for a, b in zip(pytree.tree_leaves(g1), pytree.tree_leaves(g2)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"must be bool \[B, 1, S, S\]"):
        loss_fn(params, {**batch, "attention_mask": prepared["attention_mask"].float()})


def test_a_4d_mask_whose_masked_token_others_attend_to_is_refused():
    model = tiny_model("mixtral")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch(seq=8)
    mask = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8).clone()
    mask[0, 0, 3, 3] = False                       # token 3 sees nothing of itself, 4.. see it
    batch["labels"][0, 3:5] = -100
    with pytest.raises(ValueError, match="let no token attend to a masked one"):
        loss_fn(params, {**batch, "attention_mask": mask})


def test_the_models_own_parameters_stay_the_same_objects():
    """An optimizer built on model.parameters() before from_hf_model still trains the
    experts: the Parameters are kept, only what they hold changes."""
    model = tiny_model("qwen3_moe")
    before = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    params, loss_fn = psf.from_hf_model(model)
    assert all(p is before[n] for n, p in model.named_parameters())
    expert = model.model.layers[0].mlp.experts.gate_up_proj
    old = expert.detach().clone()
    model(**lm_batch()).loss.backward()
    opt.step()
    assert not torch.equal(expert.detach(), old)
    torch.testing.assert_close(params["model.layers.0.mlp"]["w_gate_up"], expert.transpose(1, 2))


def test_changes_to_the_model_after_from_hf_model_are_caught():
    model = tiny_model("olmoe")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    model.config.output_router_logits = True          # read at every call, as transformers
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)
    model.config.output_router_logits = False
    # transformers >= 5.24 names it activation checkpointing (the old names warn); 5.17 has
    # only the old ones: the refusal names the method this version has
    new = hasattr(model, "activation_checkpointing_enable")
    enable, disable = ("activation_checkpointing_enable", "activation_checkpointing_disable") \
        if new else ("gradient_checkpointing_enable", "gradient_checkpointing_disable")
    getattr(model, enable)()
    with pytest.raises(ValueError, match=rf"model\.{disable}\(\)"):
        loss_fn(params, batch)
    getattr(model, disable)()
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="model changed since.*another dtype.*"
                                         "from_hf_model\\(model\\) again"):
        loss_fn(params, batch)
    params, loss_fn = psf.from_hf_model(model)          # and again after the move: fine
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss.float(),
                               rtol=2e-2, atol=0)


def _new_router(model):
    gate = model.model.layers[0].mlp.gate
    gate.weight = torch.nn.Parameter(gate.weight.detach() * 2)


def _data_assigned(model):
    model.model.norm.weight.data = model.model.norm.weight.detach() + 1


def _partial_load(model):
    name = "model.layers.2.post_attention_layernorm.weight"
    model.load_state_dict({name: torch.ones(32)}, strict=False, assign=True)


def _new_head(model):
    model.lm_head = torch.nn.Linear(32, 64, bias=False)


def _transposed_view(model):
    attn = model.model.layers[0].self_attn.o_proj          # square [32, 32]: same address
    attn.weight.data = attn.weight.data.t()


def _top_k(model):
    model.model.layers[0].mlp.gate.top_k = 1


def _norm_topk(model):
    gate = model.model.layers[0].mlp.gate
    gate.norm_topk_prob = not gate.norm_topk_prob


def _bias(model):
    gate = model.model.layers[1].mlp.gate
    gate.e_score_correction_bias = gate.e_score_correction_bias + 0.5


@pytest.mark.parametrize("family, change, said", [
    ("qwen3_moe", _new_router, r"layers.0.mlp.gate.weight has another memory"),
    ("qwen3_moe", _data_assigned, r"model.norm.weight has another memory"),
    ("qwen3_moe", lambda m: m.resize_token_embeddings(72), r"embed_tokens.weight has another "
                                                           r"shape \(\[64, 32\] -> \[72, 32\]\)"),
    ("qwen3_moe", _partial_load, r"layers.2.post_attention_layernorm.weight has another memory"),
    ("qwen3_moe", _new_head, r"lm_head.weight has another memory"),
    ("qwen3_moe", _transposed_view, r"o_proj.weight has another layout over the same memory"),
    ("qwen3_moe", _top_k, r"layers.0.mlp.gate.top_k is 1, was 2"),
    ("olmoe", _norm_topk, r"layers.0.mlp.gate.norm_topk_prob is (True, was False|False, was True)"),
    ("deepseek_v3", _bias, r"layers.1.mlp.gate.e_score_correction_bias has another memory"),
])
def test_a_model_changed_after_from_hf_model_is_refused_at_the_next_call(family, change, said):
    """Each change would make the psf loss differ from the model's own (or train tensors the
    model no longer uses): the next call refuses it, naming what changed."""
    model = tiny_model(family)
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)
    with torch.no_grad():
        change(model)
    with pytest.raises(ValueError, match="the model changed since psf.from_hf_model took its "
                                         "params: .*" + said):
        loss_fn(params, batch)


def test_objects_replaced_over_the_same_tensors_are_accepted():
    """No false alarm where the model still computes what params give: the documented round
    trip through to_hf_state_dict with assign=True (new Parameter objects over the same
    memory), and a module without parameters replaced."""
    model = tiny_model("qwen3_moe")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    model.load_state_dict(psf.to_hf_state_dict(params, model), assign=True)
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)
    model.model.layers[0].mlp_dropout = torch.nn.Identity()       # a child with no params
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)
    with torch.no_grad():
        params["model.norm.weight"].mul_(2)            # still shared after the round trip
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)


def test_a_weight_changed_in_place_is_followed_by_both():
    """In place, through params or through the model, needs nothing: they share it."""
    model = tiny_model("qwen3_moe")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    with torch.no_grad():
        params["model.norm.weight"].mul_(1.5)
        model.model.layers[0].mlp.gate.weight.add_(0.1)
        params["model.layers.0.mlp"]["w_down"].mul_(0.5)
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)


def test_one_model_in_two_threads_at_once_is_refused_and_forwards_come_back():
    import threading
    from pagedstash_func.interop._models import _lock_of
    model = tiny_model("mixtral")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    errors = []
    with _lock_of(model):                  # as if another thread's loss were running
        worker = threading.Thread(target=lambda: errors.append(_raises(loss_fn, params, batch)))
        worker.start()
        worker.join()
    assert "in another thread" in errors[0]
    bad = {**batch, "input_ids": batch["input_ids"] + 1000}     # fails inside the forward
    with pytest.raises(IndexError):
        loss_fn(params, bad)
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)


def test_a_second_thread_while_a_forward_runs_is_told_so_not_that_the_model_changed():
    """One thread inside the loss's forward (functional_call has put params into the
    modules), another calls the loss: it is refused as a second thread, and the first
    finishes with transformers' loss."""
    import threading
    model = tiny_model("qwen3_moe")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    inside, go = threading.Event(), threading.Event()

    def hold(module, args):
        inside.set()
        go.wait(timeout=60)
    handle = model.model.norm.register_forward_pre_hook(hold)
    out = []
    first = threading.Thread(target=lambda: out.append(loss_fn(params, batch)[0]))
    first.start()
    assert inside.wait(timeout=60)
    said = _raises(loss_fn, params, batch)
    go.set()
    first.join(timeout=60)
    handle.remove()
    assert "in another thread" in said, said
    torch.testing.assert_close(out[0], model(**batch).loss)


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as err:          # noqa: BLE001 - the message is what the test reads
        return str(err)
    return ""


def test_labels_that_are_not_int64_are_refused():
    model = tiny_model("mixtral")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    with pytest.raises(ValueError, match="must be int64 token ids"):
        loss_fn(params, {**batch, "labels": batch["labels"] > 5})
    with pytest.raises(ValueError, match="must be a tensor, got list"):
        loss_fn(params, {**batch, "attention_mask": [[1] * 12] * 2})


def test_a_second_derivative_through_the_chunked_loss_is_refused():
    model = tiny_model("olmoe", layers=1)
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch(batch=1, seq=6)
    key = "model.norm.weight"

    def penalty(p):
        return torch.func.grad(lambda q: loss_fn(q, batch)[0])(p)[key].pow(2).sum()

    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.func.grad(penalty)(params)


def test_the_loss_identity_sees_the_mode_and_the_attention_implementation():
    """A step file saved from a model in eval mode must not replay on one in train mode
    (dropout), nor across attention implementations: neither is in the config's JSON."""
    from pagedstash_func.step._identity import loss_identity
    model = tiny_model("qwen3_moe").eval()
    _, loss_fn = psf.from_hf_model(model)
    first = loss_identity(loss_fn)
    assert loss_identity(loss_fn) == first
    model.train()
    trained = loss_identity(loss_fn)
    assert trained != first
    model.eval()
    assert loss_identity(loss_fn) == first
    model.config._attn_implementation = "eager"
    assert loss_identity(loss_fn) not in (first, trained)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_router_aux_loss_equals_transformers_total_loss(family, masked):
    """output_router_logits=True: transformers adds router_aux_loss_coef times its
    load-balancing loss; psf's loss (and every gradient) equals that total, also through
    run_step with a capacity that drops pairs (it reruns)."""
    model = tiny_model(family)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5          # read by the forward; large enough to matter
    batch = lm_batch(pad_from=8 if masked else None)
    ref_loss, ref_grads = hf_loss_and_grads(model, batch)
    params, loss_fn = psf.from_hf_model(model)
    (loss, _), grads = torch.func.grad_and_value(loss_fn, has_aux=True)(params, batch)[::-1]
    assert_close_to_hf(loss, psf.to_hf_state_dict(grads, model), ref_loss, ref_grads)
    model.config.output_router_logits = False
    plain = loss_fn(params, batch)[0]
    assert not torch.allclose(plain, loss)
    model.config.output_router_logits = True
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=0.5, expert_ranks=2))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.reran
    assert_close_to_hf(res.loss, psf.to_hf_state_dict(res.grads, model), ref_loss, ref_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_norms_run_and_equal_the_models_own(family, monkeypatch):
    """Every RMSNorm of the model runs as psf.rms_norm while the loss runs (counted), and the
    loss and gradients equal those with the model's own norms, and transformers'."""
    import pagedstash_func.interop._models as models
    model = tiny_model(family)
    batch = lm_batch(pad_from=8)
    ref_loss, ref_grads = hf_loss_and_grads(model, batch)
    calls = []
    real = models.rms_norm
    monkeypatch.setattr(models, "rms_norm", lambda *a: calls.append(1) or real(*a))
    params, loss_fn = psf.from_hf_model(model)
    expected = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    assert len(loss_fn.norms) == expected > 0
    (loss, _), grads = torch.func.grad_and_value(loss_fn, has_aux=True)(params, batch)[::-1]
    assert len(calls) == expected
    assert_close_to_hf(loss, psf.to_hf_state_dict(grads, model), ref_loss, ref_grads)
    _, plain_fn = psf.from_hf_model(model, fused_norms=False)
    calls.clear()
    torch.testing.assert_close(plain_fn(params, batch)[0], loss, rtol=1e-6, atol=1e-6)
    assert not calls
    with pytest.raises(ValueError, match="fused_norms"):
        psf.from_hf_model(model, fused_norms="yes")


def test_packed_sequences_are_still_found_outside_a_loss():
    """The loss answers transformers' look for packed sequences itself (its positions are
    the model's own arange); outside a loss transformers' function answers as before."""
    from transformers import masking_utils
    model = tiny_model("qwen3_moe")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    torch.testing.assert_close(loss_fn(params, batch)[0], model(**batch).loss)
    find = masking_utils.find_packed_sequence_indices
    assert find.__wrapped__ is not None
    torch.testing.assert_close(find(torch.tensor([[0, 1, 2, 0, 1]])),
                               torch.tensor([[0, 0, 0, 1, 1]]))
    assert find(torch.arange(5)[None]) is None


def test_a_loss_without_padding_stays_causal_where_transformers_would_build_a_mask(
        monkeypatch):
    """Under CUDA-graph capture transformers 5.17 builds a full mask even with no padding
    mask (its tracing check); simulated here by transformers' answer always saying so. The
    loss still hands sdpa no mask (its causal kernels), equal to transformers' own masked
    forward; with a padding mask transformers' answer stands."""
    from transformers import masking_utils
    model = tiny_model("qwen3_moe")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch()
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    loss_fn(params, batch)                     # installs the loss's answer
    monkeypatch.setattr(masking_utils._ignore_causal_mask_sdpa, "__wrapped__",
                        lambda *a, **k: False)
    loss = loss_fn(params, batch)[0]
    assert masks and all(m is None for m in masks)
    masks.clear()
    ref = model(**batch).loss                  # transformers, with its full mask
    assert masks and all(m is not None for m in masks)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    masks.clear()
    loss_fn(params, lm_batch(pad_from=8))
    assert masks and all(m is not None for m in masks)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_checkpointed_attention_gives_the_same_gradients_through_run_step(family):
    """checkpoint_attention recomputes each attention block in backward: run_step (with drops
    and a rerun, and with the stash) equals the loss without checkpointing; torch.func
    transforms are refused with the fix."""
    model = tiny_model(family)
    batch = lm_batch(pad_from=8)
    params, plain = psf.from_hf_model(model)
    _, ckpt = psf.from_hf_model(model, checkpoint_attention=True)
    assert len(ckpt.attention) == model.config.num_hidden_layers
    ref = psf.value_and_grad(plain, has_aux=True)(params, batch)
    got = psf.value_and_grad(ckpt, has_aux=True)(params, batch)
    torch.testing.assert_close(got[1][0], ref[1][0], rtol=0, atol=0)
    for a, b in zip(pytree.tree_leaves(got[0]), pytree.tree_leaves(ref[0])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    cfg = psf.StashConfig(capacity_factor=0.5, expert_ranks=2, paged_stash=True)
    step = psf.stash_aware(ckpt, cfg)
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.reran
    for a, b in zip(pytree.tree_leaves(res.grads), pytree.tree_leaves(ref[0])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="torch.func transforms refuse"):
        torch.func.grad(lambda p, b: ckpt(p, b)[0])(params, batch)
    # params that are not the model's own tensors: the recompute must use them, not the
    # model's attributes as they are when backward runs
    other = pytree.tree_map(lambda t: t * 1.01, params)
    ref = psf.value_and_grad(plain, has_aux=True)(other, batch)
    got = psf.value_and_grad(ckpt, has_aux=True)(other, batch)
    for a, b in zip(pytree.tree_leaves(got[0]), pytree.tree_leaves(ref[0])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_batches_padded_to_a_bucket_give_the_unpadded_loss_and_gradients():
    """Varying lengths padded to a few buckets: the loss and every gradient equal the
    unpadded batch's exact path; one state per bucket serves every batch of its shape, and
    the padded positions take no capacity."""
    model = tiny_model("qwen3_moe")
    params, loss_fn = psf.from_hf_model(model)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.0, expert_ranks=2,
                                                    paged_stash=True, pool_scope="layer"))
    states = {}
    for seq in (7, 12, 5, 16):
        raw = lm_batch(seq=seq, seed=seq)
        padded = psf.pad_to_bucket(raw, buckets=(8, 16))
        bucket = padded["input_ids"].shape[1]
        assert bucket == (8 if seq <= 8 else 16)
        ref = psf.value_and_grad(loss_fn, has_aux=True)(params, raw)
        state = states.get(bucket) or step.init(params, padded)
        res = psf.run_step(step, params, padded, state)
        states[bucket] = res.state
        torch.testing.assert_close(res.loss, ref[1][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(pytree.tree_leaves(res.grads), pytree.tree_leaves(ref[0])):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        real = 2 * seq
        assert all(sum(layer.expert_load) == real * 2 for layer in res.report.layers)
    assert sorted(states) == [8, 16]
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        psf.pad_to_bucket(lm_batch(seq=20), buckets=(8, 16))


def test_the_documented_loop_trains_what_transformers_trains_and_leaves_the_bias_alone():
    """psf.trainable + psf.set_grads with a torch.optim optimizer (weight decay on, which
    moves any parameter handed a gradient, zero or not) against transformers' own loop over
    model.parameters(): the same weights after three steps, and DeepSeek-V3's
    score-correction bias (a buffer, never trained) untouched bit for bit. (SGD rather than
    Adam: Adam divides by each gradient's own size, so the fp32 rounding of a near-zero
    gradient would show as a difference of the weights.)"""
    ours, theirs = tiny_model("deepseek_v3"), tiny_model("deepseek_v3")
    params, loss_fn = psf.from_hf_model(ours)
    bias = {n: b.clone() for n, b in ours.named_buffers() if n.endswith("correction_bias")}
    assert bias
    leaves = psf.trainable(params)
    assert len(leaves) == len(list(theirs.parameters()))
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=True))
    batch = lm_batch()
    state = step.init(params, batch)
    opt = torch.optim.SGD(leaves, lr=0.5, momentum=0.9, weight_decay=0.1)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for _ in range(3):
        res = psf.run_step(step, params, batch, state)
        state = res.state
        psf.set_grads(params, res.grads)
        opt.step()
        ref_opt.zero_grad()
        theirs(**batch).loss.backward()
        ref_opt.step()
    mine = psf.to_hf_state_dict(params, ours)
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(mine[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
    for name, b in bias.items():
        assert torch.equal(dict(ours.named_buffers())[name], b)
    with pytest.raises(ValueError, match="grads are not shaped like params"):
        psf.set_grads(params, {k: v for k, v in res.grads.items() if k != "lm_head.weight"})


def test_a_router_that_cannot_route_is_refused_by_name():
    """DeepSeek-V3 with n_group=4 over 4 experts (a group is scored by its two best): refused
    as a ValueError when the model is taken, before any batch (with or without a mask) runs;
    and the router itself refuses at every routing, whichever path calls it."""
    import transformers
    config = tiny_model("deepseek_v3").config
    config.n_group, config.topk_group = 4, 2
    bad = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="groups=4\\) leaves fewer than 2 experts a group"):
        psf.from_hf_model(bad)
    from pagedstash_func.core._router import Router, route_with
    with pytest.raises(ValueError, match="leaves fewer than 2 experts a group"):
        route_with(torch.randn(4, 8), torch.randn(3, 8), 2, Router(scores="sigmoid", groups=4))

def test_a_model_whose_experts_are_already_a_shard_is_refused():
    """from_hf_model(model, group=...) leaves the model's expert Parameters holding this
    rank's shard; taking such a model again would shard the shard."""
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.data = experts.gate_up_proj.data[:2]
        experts.down_proj.data = experts.down_proj.data[:2]
    with pytest.raises(ValueError, match="hold a shard of the router's experts.*build or "
                                         "load the model again"):
        psf.from_hf_model(model)


@pytest.mark.parametrize("family,cf,pad_from", [("qwen3_moe", 0.5, 7),   # padded, reruns
                                                ("deepseek_v3", 2.0, None)])
def test_a_compiled_step_of_the_whole_model_equals_eager_and_transformers(family, cf,
                                                                           pad_from):
    """psf.compile over a from_hf_model loss, stash included: attention, norms, rotary,
    routers, the experts and the chunked LM loss in one graph (no break), its host side (the
    model's lock and checks, its patched blocks) held outside it; the eager step's numbers,
    and transformers' own."""
    torch._dynamo.reset()
    model = tiny_model(family)
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch(pad_from=pad_from)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=cf, paged_stash=True,
                                                    pool_scope="layer", cuda_factor=0.75,
                                                    expert_ranks=2))
    compiled = psf.compile(step, backend="aot_eager")
    state = step.init(params, batch)
    explained = torch._dynamo.explain(compiled._body)
    with loss_fn.held():
        graphs = explained(params, batch, state, True)
    assert graphs.graph_break_count == 0, [b.reason for b in graphs.break_reasons]
    a = psf.run_step(compiled, params, batch, compiled.init(params, batch))
    b = psf.run_step(step, params, batch, step.init(params, batch))
    assert a.report.reran == b.report.reran == (cf < 1)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
    for x, y in zip(pytree.tree_leaves(a.grads), pytree.tree_leaves(b.grads)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    ref_loss, ref_grads = hf_loss_and_grads(model, batch)
    assert_close_to_hf(a.loss, psf.to_hf_state_dict(a.grads, model), ref_loss, ref_grads)
    if family == "qwen3_moe":   # a part left to eager (fullgraph=False) runs held, as one
        hook = model.model.layers[1].register_forward_hook(
            lambda *args: torch._dynamo.graph_break())
        broken = psf.compile(step, backend="aot_eager", fullgraph=False)
        c = psf.run_step(broken, params, batch, broken.init(params, batch))
        hook.remove()
        torch.testing.assert_close(c.loss, b.loss, rtol=1e-6, atol=1e-7)
        loss_fn.checkpoint_attention = True
        with pytest.raises(ValueError, match="checkpoint_attention=True does not compile"):
            compiled.attempt(params, batch, compiled.init(params, batch))
        loss_fn.checkpoint_attention = False
    plain = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0))   # no stash
    with pytest.raises(Exception, match=r"psf.compile\(psf.stash_aware"):   # a bare compile
        torch.compile(plain.attempt, fullgraph=True, backend="aot_eager")(
            params, batch, plain.init(params, batch))
