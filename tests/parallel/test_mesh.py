"""Expert parallelism inside data parallelism on a ("dp", "ep") mesh of four gloo ranks: the
reduced gradients and the clipped norm equal one process on the global batch (fp64)."""

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from worlds import no_failures, spawn_world

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 16

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def _full():
    g = torch.Generator().manual_seed(0)
    return {"moe": psf.moe_init(E, H, F, generator=g, dtype=torch.float64),
            "head": torch.randn(H, 3, generator=g, dtype=torch.float64)}


def _batch(rank):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank),
                       dtype=torch.float64)


def _loss(params, x, group):
    h = x + psf.moe(params["moe"], x, top_k=K, group=group)
    return (h @ params["head"]).square().sum() / (4 * T)      # a share of the global mean


def mesh_world(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    full = _full()
    params = {"moe": psf.shard_experts(full["moe"], mesh), "head": full["head"]}
    grads = torch.func.grad(_loss)(params, _batch(rank), mesh)
    psf.reduce_gradients(grads, mesh)
    ref = torch.func.grad(lambda p: sum(_loss(p, _batch(r), None) for r in range(4)))(full)
    ep = mesh.get_local_rank("ep")
    per = E // 2
    want = {"router": ref["moe"]["router"], "head": ref["head"],
            "w_gate_up": ref["moe"]["w_gate_up"][ep * per:(ep + 1) * per],
            "w_down": ref["moe"]["w_down"][ep * per:(ep + 1) * per]}
    got = {"router": grads["moe"]["router"], "head": grads["head"],
           "w_gate_up": grads["moe"]["w_gate_up"], "w_down": grads["moe"]["w_down"]}
    equal = all(torch.allclose(got[k], want[k], rtol=1e-10, atol=1e-13) for k in want)
    norm = psf.clip_grad_norm(grads, 1e-3, mesh)
    ref_norm = torch.sqrt(sum(t.square().sum() for t in pytree.tree_leaves(ref)))
    clipped = torch.sqrt(grads["head"].square().sum()) / torch.sqrt(ref["head"].square().sum())
    try:
        psf.moe(full["moe"], _batch(rank), top_k=K, group=mesh)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return (equal, bool(torch.allclose(norm, ref_norm, rtol=1e-10)),
            bool(torch.allclose(clipped, 1e-3 / ref_norm, rtol=1e-5)),
            "psf.shard_experts(params, group)" in refused)


def test_a_dp_by_ep_mesh_equals_one_process_on_the_global_batch():
    values = spawn_world(4, [mesh_world])["mesh_world"]
    no_failures(values)
    assert values == [(True, True, True, True)] * 4


def bad_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    try:
        psf.reduce_gradients({"a": torch.zeros(1)}, mesh)
    except ValueError as err:
        return "('dp', 'ep')" in str(err)
    return False


def test_a_mesh_without_the_two_dims_is_refused():
    values = spawn_world(2, [bad_mesh])["bad_mesh"]
    no_failures(values)
    assert values == [True, True]


def whole_model_sharded(rank, world):
    """A tiny Qwen3-MoE model with its experts sharded over two ranks (from_hf_model(group=)),
    each rank its own batch: the loss and the reduced gradients equal one process on both
    batches (the mean of the two losses), through run_step at capacity factor 0.5."""
    import sys
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/interop")
    from hf_tiny import lm_batch, tiny_model
    model = tiny_model("qwen3_moe").double()
    ref_model = tiny_model("qwen3_moe").double()
    params, loss_fn = psf.from_hf_model(model, group=dist.group.WORLD)
    batches = [lm_batch(seed=r) for r in range(world)]
    mine = batches[rank]
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=0.5))
    res = psf.run_step(step, params, mine, step.init(params, mine))
    grads = psf.reduce_gradients(res.grads, dist.group.WORLD)
    ref_params, ref_loss = psf.from_hf_model(ref_model)
    ref = psf.value_and_grad(lambda p: sum(ref_loss(p, b)[0] for b in batches) / world)(
        ref_params)[0]
    per = 4 // world          # every gradient is now d(L0 + L1): shards and replicated alike
    ok = True
    for name, g in grads.items():
        if isinstance(g, dict):
            for k, v in g.items():
                want = ref[name][k] if k == "router" else \
                    ref[name][k][rank * per:(rank + 1) * per]
                ok &= bool(torch.allclose(v / world, want, rtol=1e-8, atol=1e-10))
        else:
            ok &= bool(torch.allclose(g / world, ref[name], rtol=1e-8, atol=1e-10))
    whole = sum(ref_loss(ref_params, b)[0] for b in batches) / world
    total = res.loss.clone()
    dist.all_reduce(total)
    return ok, bool(torch.allclose(total / world, whole, rtol=1e-10))


def test_a_whole_model_sharded_over_two_ranks_equals_one_process():
    values = spawn_world(2, [whole_model_sharded])["whole_model_sharded"]
    no_failures(values)
    assert values == [(True, True)] * 2


def mesh_counts(rank, world):
    """global_counts over a mesh sums every rank's pairs; update_expert_bias over it sums
    over dp (a report's loads are already summed over ep)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    counts = torch.zeros(E)
    counts[rank] = 1.0
    total = psf.global_counts([counts], mesh)
    bias = psf.update_expert_bias(torch.zeros(E), counts * (1 + mesh.get_local_rank("ep")),
                                  rate=0.5, group=mesh)
    return total.tolist(), bias.tolist()


def test_counts_and_the_bias_update_over_a_mesh():
    values = spawn_world(4, [mesh_counts])["mesh_counts"]
    no_failures(values)
    for rank, (total, bias) in enumerate(values):
        assert total == [1.0] * 4 + [0.0] * 4
        ep = rank % 2                  # ranks (0, 2) and (1, 3) form the dp groups
        summed = [0.0] * E
        for dp_peer in (ep, ep + 2):
            summed[dp_peer] += 1.0 + ep
        mean = sum(summed) / E
        assert bias == [0.5 * (1 if mean > c else -1 if mean < c else 0) for c in summed]


def _adam(params, grads, moments, t, lr=1e-2):
    m, v = moments
    m = pytree.tree_map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
    v = pytree.tree_map(lambda a, g: 0.99 * a + 0.01 * g * g, v, grads)
    params = pytree.tree_map(lambda p, a, b: p - lr * (a / (1 - 0.9 ** t)) /
                             ((b / (1 - 0.99 ** t)).sqrt() + 1e-8), params, m, v)
    return params, (m, v)


def _train(params, moments, steps, start, xs, group):
    """Adam steps on the sum of the ranks' losses (xs: this process's batches per step)."""
    for t in range(start, start + steps):
        loss = lambda p: sum(_loss(p, x, group) for x in xs(t))      # noqa: E731
        grads = torch.func.grad(loss)(params)
        if group is not None:
            psf.reduce_gradients(grads, group)
        params, moments = _adam(params, grads, moments, t + 1)
    return params, moments


def resume_at_another_size(rank, world):
    """Two ranks train 2 steps, save params and Adam moments (sharded), train 2 more; one
    process loads the checkpoint whole (experts joined) and trains the same 2 steps on the
    global batch: the same parameters (fp64)."""
    import os
    import tempfile
    full = _full()
    group = dist.group.WORLD
    params = {"moe": psf.shard_experts(full["moe"], group), "head": full["head"]}
    moments = (pytree.tree_map(torch.zeros_like, params),) * 2
    mine = lambda t: [_batch(10 * t + rank)]                          # noqa: E731
    params, moments = _train(params, moments, 2, 0, mine, group)
    folder = os.environ.get("PSF_TEST_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"ckpt_{os.environ['MASTER_PORT']}")
    psf.save_sharded(path + ".params", params, group)
    psf.save_sharded(path + ".moments", list(moments), group)
    dist.barrier()
    params, moments = _train(params, moments, 2, 2, mine, group)
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v.clone() for k, v in params["moe"].items()})
    ok = True
    if rank == 0:
        whole = psf.load_sharded(path + ".params")
        m = psf.load_sharded(path + ".moments")
        both = lambda t: [_batch(10 * t + r) for r in range(world)]   # noqa: E731
        whole, _ = _train(whole, tuple(m), 2, 2, both, None)
        for k in ("w_gate_up", "w_down"):
            joined = torch.cat([g[k] for g in gathered])
            ok &= bool(torch.allclose(whole["moe"][k], joined, rtol=1e-9, atol=1e-12))
        ok &= bool(torch.allclose(whole["moe"]["router"], params["moe"]["router"], rtol=1e-9,
                                  atol=1e-12))
        ok &= type(whole["moe"]) is dict
    dist.barrier()
    again = psf.load_sharded(path + ".params", group)        # at the size it was written
    ok &= isinstance(again["moe"], psf.ExpertShard) and again["moe"]["w_gate_up"].shape[0] == 4
    dist.barrier()
    if rank == 0:
        for name in os.listdir(folder):
            if name.startswith(os.path.basename(path)):
                os.remove(os.path.join(folder, name))
    return ok


def flat_names_lose_no_experts(rank, world):
    """A checkpoint of `to_hf_state_dict` (flat names) on two expert-parallel ranks: its
    expert entries are recorded as shards, so each rank reads its own experts back; the same
    names in a plain dict (the record lost) are refused at the save, naming an expert leaf."""
    import os
    import sys
    import tempfile
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/interop")
    from hf_tiny import tiny_model
    model = tiny_model("qwen3_moe").double()
    params, _ = psf.from_hf_model(model, group=dist.group.WORLD)
    flat = psf.to_hf_state_dict(params, model)
    folder = os.environ.get("PSF_TEST_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"flat_{os.environ['MASTER_PORT']}")
    psf.save_sharded(path, flat, dist.group.WORLD)
    back = psf.load_sharded(path, dist.group.WORLD)
    same = isinstance(back, psf.HFStateDict) and back.experts == flat.experts and \
        all(torch.equal(back[k], flat[k]) for k in flat)
    try:
        psf.save_sharded(path + ".plain", dict(flat), dist.group.WORLD)
        said = ""
    except ValueError as err:
        said = str(err)
    dist.barrier()
    os.remove(f"{path}.rank{rank}-of-{world}.pt")
    return same, said


def test_a_sharded_checkpoint_resumes_at_another_size():
    values = spawn_world(2, [resume_at_another_size, flat_names_lose_no_experts])
    no_failures(values["resume_at_another_size"])
    assert values["resume_at_another_size"] == [True, True]
    said = values["flat_names_lose_no_experts"]
    no_failures(said)
    assert all(same and "experts.gate_up_proj'] holds 2 experts of its router's 4" in s
               for same, s in said), said


def test_a_corrupt_or_missing_shard_file_is_refused(tmp_path):
    tree = {"moe": psf.ExpertShard(psf.moe_init(E, H, F, dtype=torch.float64))}
    name = psf.save_sharded(tmp_path / "ck", tree)
    assert psf.load_sharded(tmp_path / "ck")["moe"]["w_down"].shape == (E, F, H)
    data = bytearray(open(name, "rb").read())
    data[len(data) // 2] ^= 1
    open(name, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="corrupted|not a readable"):
        psf.load_sharded(tmp_path / "ck")
    with pytest.raises(ValueError, match="expected one"):
        psf.load_sharded(tmp_path / "nothing")


def whole_model_on_a_mesh(rank, world):
    """The tiny Qwen3-MoE model on a dp 2 x ep 2 mesh: reduced gradients equal one process on
    the four batches; a skewed batch on rank 0 reruns its ep group {0, 1} and not the other
    replica."""
    import sys
    from torch.distributed.device_mesh import init_device_mesh
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/interop")
    from hf_tiny import lm_batch, tiny_model
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model, ref_model = tiny_model("qwen3_moe").double(), tiny_model("qwen3_moe").double()
    params, loss_fn = psf.from_hf_model(model, group=mesh)
    batches = [lm_batch(seed=r) for r in range(world)]
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=4.0))
    res = psf.run_step(step, params, batches[rank], step.init(params, batches[rank]))
    grads = psf.reduce_gradients(res.grads, mesh)
    ref_params, ref_loss = psf.from_hf_model(ref_model)
    ref = psf.value_and_grad(lambda p: sum(ref_loss(p, b)[0] for b in batches))(ref_params)[0]
    ep = mesh.get_local_rank("ep")
    ok = True
    for name, g in grads.items():
        if isinstance(g, dict):
            for k, v in g.items():
                want = ref[name][k] if k == "router" else ref[name][k][ep * 2:(ep + 1) * 2]
                ok &= bool(torch.allclose(v, want, rtol=1e-8, atol=1e-10))
        else:
            ok &= bool(torch.allclose(g, ref[name], rtol=1e-8, atol=1e-10))
    skewed = dict(batches[rank])
    if rank == 0:                     # one token repeated: every pair to the same experts
        skewed["input_ids"] = torch.full_like(skewed["input_ids"], 5)
        skewed["labels"] = skewed["input_ids"].clone()
    tight = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.0))
    again = psf.run_step(tight, params, skewed, tight.init(params, skewed))
    return ok, bool(again.report.reran)


def test_a_whole_model_on_a_dp_by_ep_mesh():
    values = spawn_world(4, [whole_model_on_a_mesh])["whole_model_on_a_mesh"]
    no_failures(values)
    assert [v[0] for v in values] == [True] * 4
    reran = [v[1] for v in values]
    assert reran[0] and reran[0] == reran[1]          # the ep group decides together
    assert reran[2] == reran[3]                        # and the other replica on its own


def unsaved_group(rank, world):
    """A sharded tree saved without its group, with several ranks running, is refused."""
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    tree = {"moe": psf.shard_experts(full, dist.group.WORLD)}
    try:
        psf.save_sharded("/nonexistent/never", tree)
        return ""
    except ValueError as err:
        return str(err)


def test_a_sharded_tree_saved_without_its_group_is_refused():
    values = spawn_world(2, [unsaved_group])["unsaved_group"]
    no_failures(values)
    assert all("no group was given" in v for v in values)


def test_files_of_two_saves_under_one_path_are_refused(tmp_path, monkeypatch):
    """One process writes a 2-rank checkpoint by hand (two ranks' files from two saves)."""
    import pagedstash_func.parallel._checkpoint as ck
    tree = {"moe": psf.ExpertShard(psf.moe_init(E, H, F, dtype=torch.float64))}
    for rank, ident in ((0, "a"), (1, "b")):
        leaves, spec = ck._leaves(tree)
        payload = {"format": ck.FORMAT, "version": ck.VERSION, "rank": rank, "ranks": 2,
                   "save": ident, "spec": torch.utils._pytree.treespec_dumps(spec),
                   "keys": [k for k, _, _ in leaves], "shard": [s for _, _, s in leaves],
                   "tensors": [leaf.clone() for _, leaf, _ in leaves]}
        payload["digest"] = ck._digest(payload)
        torch.save(payload, ck._file(tmp_path / "ck", rank, 2))
    with pytest.raises(ValueError, match="another save"):
        psf.load_sharded(tmp_path / "ck")
    with pytest.raises(ValueError, match="file stem, not a folder"):
        psf.save_sharded(str(tmp_path) + "/", tree)
    (tmp_path / "ck.rank0-of-2.bak.pt").write_bytes(b"")       # a stray file does not block
    with pytest.raises(ValueError, match="another save"):
        psf.load_sharded(tmp_path / "ck")
    view = torch.zeros(1000, 1000)[:1, :2]
    name = psf.save_sharded(tmp_path / "small", {"v": view})
    assert (tmp_path / "small.rank0-of-1.pt").stat().st_size < 100_000, name


def ep_four(rank, world):
    """Four ranks as one expert-parallel group (ep 4): reduced gradients equal one process on
    the four batches, and the clipped norm too."""
    full = _full()
    group = dist.group.WORLD
    params = {"moe": psf.shard_experts(full["moe"], group), "head": full["head"]}
    grads = torch.func.grad(_loss)(params, _batch(rank), group)
    psf.reduce_gradients(grads, group)
    ref = torch.func.grad(lambda p: sum(_loss(p, _batch(r), None) for r in range(4)))(full)
    per = E // 4
    ok = all(torch.allclose(a, b, rtol=1e-10, atol=1e-13) for a, b in (
        (grads["head"], ref["head"]), (grads["moe"]["router"], ref["moe"]["router"]),
        (grads["moe"]["w_gate_up"], ref["moe"]["w_gate_up"][rank * per:(rank + 1) * per]),
        (grads["moe"]["w_down"], ref["moe"]["w_down"][rank * per:(rank + 1) * per])))
    norm = psf.clip_grad_norm(grads, 1e-3, group)
    ref_norm = torch.sqrt(sum(t.square().sum() for t in pytree.tree_leaves(ref)))
    return ok, bool(torch.allclose(norm, ref_norm, rtol=1e-10))


def test_ep_four_equals_one_process():
    values = spawn_world(4, [ep_four])["ep_four"]
    no_failures(values)
    assert values == [(True, True)] * 4


def nvshmem_on_ep_subgroups(rank, world):
    """The NVSHMEM transport (its op emulated on gloo, its workspace keyed by group) on the ep
    groups of a dp 2 x ep 2 mesh: the same bits as fixed slots, with drops (cf 0.5) and
    without."""
    from test_expert_parallel import EmulatedNvshmem
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    full = _full()
    params = {"moe": psf.shard_experts(full["moe"], mesh), "head": full["head"]}
    x = _batch(rank)
    same = []
    with EmulatedNvshmem():
        for cf in (4.0, 0.5):
            outs = []
            for transport in ("fixed", "nvshmem"):
                step = psf.stash_aware(lambda p, b: _loss(p, b, mesh), psf.StashConfig(
                    capacity_factor=cf, paged_stash=True, page_size=8, transport=transport))
                attempt = psf.value_and_grad(step.attempt, has_aux=True)
                grads, (loss, _) = attempt(params, x, step.init(params, x))
                outs.append((loss, pytree.tree_leaves(grads)))
            (l0, g0), (l1, g1) = outs
            same.append(torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1)))
    return same


def test_the_nvshmem_transport_on_ep_subgroups_gives_fixed_slots_bits():
    values = spawn_world(4, [nvshmem_on_ep_subgroups])["nvshmem_on_ep_subgroups"]
    no_failures(values)
    assert values == [[True, True]] * 4
