"""ZeRO-1 (psf.sharded_optimizer): torch.optim.AdamW over master weights sharded over the
ranks that replicate each parameter equals one process's torch.optim.AdamW on the global
batch, over 10 steps on a dp 2 x ep 2 mesh and on dp 4, with clipping and reruns (and 4 with
micro-batches); its state saved on 4 ranks resumes on 2 and in one process; each rank holds
its share."""

import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from worlds import no_failures, spawn_world

import pagedstash_func as psf

E, H, F, K, T, STEPS = 8, 16, 24, 2, 16, 10
RANKS = 4

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def _full():
    g = torch.Generator().manual_seed(0)
    return {"moe": psf.ExpertShard(psf.moe_init(E, H, F, generator=g)),
            "head": torch.randn(H, 3, generator=g), "norm": torch.ones(H)}


def _batch(t, rank):
    return {"x": torch.randn(T, H, generator=torch.Generator().manual_seed(1000 * t + rank))}


def _loss_of(group):
    def loss(params, batch):
        x = batch["x"] * params["norm"]
        h = x + psf.moe(params["moe"], x, top_k=K, group=group)
        return (h @ params["head"]).square().sum() / (RANKS * T)    # a share of the mean
    return loss


def _reference(steps, max_norm):
    """One process, torch.optim.AdamW on the global batch (every rank's tokens)."""
    params = pytree.tree_map(lambda t: t.clone().requires_grad_(), _full())
    leaves = pytree.tree_leaves(params)
    opt = torch.optim.AdamW(leaves, lr=1e-2, weight_decay=0.1)
    loss = _loss_of(None)
    for t in range(steps):
        opt.zero_grad()
        sum(loss(params, _batch(t, r)) for r in range(RANKS)).backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(leaves, max_norm)
        opt.step()
    return pytree.tree_map(lambda x: x.detach(), params)


def _run(mesh, steps, max_norm, micro=False, opt=None, params=None, start=0, batch_of=None):
    rank = dist.get_rank()
    batch_of = batch_of or (lambda t: _batch(t, rank))
    if params is None:
        full = _full()
        params = {**full, "moe": psf.shard_experts(full["moe"], mesh)}
    if opt is None:
        opt = psf.sharded_optimizer(params, mesh, torch.optim.AdamW, lr=1e-2,
                                    weight_decay=0.1, max_norm=max_norm)
    cfg = psf.StashConfig(capacity_factor=0.6, paged_stash=True, page_size=8)
    step = psf.stash_aware(_loss_of(mesh), cfg)
    state, reran = None, 0
    for t in range(start, start + steps):
        batch = batch_of(t)
        if micro:                   # two halves of the batch, summed (weights 1)
            halves = [{"x": batch["x"][:T // 2] * 1}, {"x": batch["x"][T // 2:] * 1}]
            halves = [{"x": torch.cat([h["x"], h["x"] * 0])} for h in halves]
            state = state or step.init(params, halves[0])
            res = psf.run_micro_batches(step, params, halves, state, weights=[1.0, 1.0])
        else:
            state = state or step.init(params, batch)
            res = psf.run_step(step, params, batch, state)
            reran += res.report.reran
        state = res.state
        opt.step(params, res.grads)
    return params, opt, reran


def _whole(params, mesh):
    """The experts of every ep rank joined (as one process holds them)."""
    ep = mesh.get_group("ep")
    parts = [None] * dist.get_world_size(ep)
    dist.all_gather_object(parts, {k: v.clone() for k, v in params["moe"].items()}, group=ep)
    moe = {k: torch.cat([p[k] for p in parts]) if k in psf.ExpertShard.SHARDED else parts[0][k]
           for k in parts[0]}
    # numpy arrays go back to the test by value (a tensor's storage by a file descriptor)
    return pytree.tree_map(lambda t: t.detach().numpy().copy(), {**params, "moe": moe})


def _gap(a, b):
    return max(float((torch.as_tensor(x) - y).abs().max() / y.abs().max().clamp_min(1e-6))
               for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


def on_meshes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    # (1, 4): the experts' pieces shared by no rank, made again after the norm's pass
    for dp, ep in ((2, 2), (4, 1), (1, 4)):
        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
        params, opt, reran = _run(mesh, STEPS, max_norm=0.05)
        out[f"{dp}x{ep}"] = (_whole(params, mesh), reran, opt.state_bytes())
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "ep"))
    params, _, _ = _run(mesh, 4, max_norm=None, micro=True)          # 4 steps: time
    out["micro"] = _whole(params, mesh)
    # saved after 5 steps on a (2, 2) mesh, resumed on the pair {0, 1} as ep 2 (dp 1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    params, opt, _ = _run(mesh, 5, max_norm=None)
    path = os.path.join(os.environ["PSF_ZERO_DIR"], "opt")
    psf.save_checkpoint(path, {"params": params, "opt": opt.state_tree()}, mesh)
    dist.barrier()
    return out


def plan_on_mesh(rank, world):
    """A tiny Qwen3-MoE built on a dp 2 x ep 2 mesh: the bytes its sharded optimizer holds
    after a step, its weights', and plan_memory's for the mesh and for its sizes alone; the
    gradient pieces a clipped step holds beyond an unclipped one's, and the plan's, there and
    on a dp 1 x ep 4 mesh (where the experts' pieces are no other rank's)."""
    from torch.distributed.device_mesh import init_device_mesh
    transformers = pytest.importorskip("transformers")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=48, num_experts=8, head_dim=32,
        num_experts_per_tok=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    params, _ = psf.from_hf_config(config, group=mesh, dtype=torch.bfloat16)
    opt = psf.sharded_optimizer(params, mesh)
    opt.step(params, pytree.tree_map(torch.zeros_like, params))
    plans = [psf.plan_memory(config, 128, mesh=m) for m in (mesh, {"dp": 2, "ep": 2})]
    # an unclipped step goes a bucket at a time; a clipped one holds the reduced pieces from
    # the norm's pass to their step: with a norm that never clips (a scale of exactly 1),
    # the same bits
    same, pieces = _clipped_pieces(config, mesh, params)
    four = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    _, alone = _clipped_pieces(config, four, psf.from_hf_config(
        config, group=four, dtype=torch.bfloat16)[0])
    return (opt.state_bytes(), sum(t.nbytes for t in pytree.tree_leaves(params)),
            [(p.master + p.optimizer_state, p.weights) for p in plans], same, pieces, alone)


def _clipped_pieces(config, mesh, params):
    """Three steps unclipped and clipped by a norm that never clips (a scale of exactly 1):
    whether they give the same bits, and ``(measured, planned, buckets)``: the most bytes of
    gradient pieces alive as each is made and as each bucket is stepped, clipped over
    unclipped, and the plan's optimizer workspace likewise."""
    import pagedstash_func.parallel._zero as zero
    trees = [pytree.tree_map(lambda t: t.float().clone(), params) for _ in range(2)]
    steppers = [psf.sharded_optimizer(tree, mesh, lr=1e-2, max_norm=norm)
                for tree, norm in zip(trees, (None, 1e30))]
    made, held, now = [], [0, 0], [0]

    def count():                  # the pieces alive now, most over the stepper's steps
        alive = sum(r().nbytes for r in made if r() is not None)
        held[now[0]] = max(held[now[0]], alive)
    reduce = zero._Bucket.reduce

    def tracked(self, grads):     # each piece made: for the norm's pass, or for its step
        piece = reduce(self, grads)
        made.append(weakref.ref(piece))
        count()
        return piece

    def counting(step):           # and whenever a bucket is stepped
        def run(*args, **kwargs):
            count()
            return step(*args, **kwargs)
        return run
    zero._Bucket.reduce = tracked
    for stepper in steppers:
        stepper.optimizer.step = counting(stepper.optimizer.step)
    try:
        for t in range(3):
            grads = pytree.tree_map(lambda p: torch.randn(
                p.shape, generator=torch.Generator().manual_seed(t + 10 * dist.get_rank())),
                trees[0])
            for i, (tree, stepper) in enumerate(zip(trees, steppers)):
                now[0] = i
                stepper.step(tree, grads)
    finally:
        zero._Bucket.reduce = reduce
    same = all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(trees[0]),
                                                 pytree.tree_leaves(trees[1])))
    workspace = [psf.plan_memory(config, 128, mesh=mesh, max_norm=norm).by_moment[
        "optimizer"]["workspace"] for norm in (None, 1.0)]
    return same, (held[1] - held[0], workspace[1] - workspace[0], len(steppers[0].buckets))


def resume_on_two(rank, world):
    """The (2, 2) mesh's checkpoint after 5 steps, resumed on two ranks (ep 2): each takes
    two of the four ranks' tokens, 5 more steps."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    full = _full()
    params = {**full, "moe": psf.shard_experts(full["moe"], mesh)}
    opt = psf.sharded_optimizer(params, mesh, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    path = os.path.join(os.environ["PSF_ZERO_DIR"], "opt")
    back = psf.load_checkpoint(path, {"params": params, "opt": opt.state_tree()}, mesh)
    with torch.no_grad():
        for p, q in zip(pytree.tree_leaves(params), pytree.tree_leaves(back["params"])):
            p.copy_(q)
    opt.load_state_tree(back["opt"])
    both = lambda t: {"x": torch.cat([_batch(t, 2 * rank)["x"],          # noqa: E731
                                      _batch(t, 2 * rank + 1)["x"]])}
    params, _, _ = _run(mesh, 5, None, opt=opt, params=params, start=5, batch_of=both)
    return _whole(params, mesh)


def mis_sized(rank, world):
    """Params sharded over ep 2 given with a mesh of ep 1, and a shard whose record is lost:
    each refused on every rank, before any collective."""
    from torch.distributed.device_mesh import init_device_mesh
    two = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    one = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "ep"))
    params = {"moe": psf.shard_experts(psf.moe_init(E, H, F), two), "head": torch.zeros(H, 3)}
    said = []
    for tree, mesh in ((params, one), ({"moe": dict(params["moe"])}, two)):
        try:
            psf.sharded_optimizer(tree, mesh)
            said.append("")
        except ValueError as err:
            said.append(str(err))
    opt = psf.sharded_optimizer(params, two)          # one rank steps other tensors: all stop
    grads = pytree.tree_map(torch.ones_like, params)
    try:
        opt.step(params if rank else pytree.tree_map(torch.clone, params), grads)
        said.append("")
    except ValueError as err:
        said.append(str(err))
    return said


def test_sharded_adamw_equals_one_process_adamw(tmp_path, monkeypatch):
    monkeypatch.setenv("PSF_ZERO_DIR", str(tmp_path))
    world = spawn_world(RANKS, [on_meshes, plan_on_mesh])
    values = world["on_meshes"]
    no_failures(values)
    no_failures(world["plan_on_mesh"])
    for held, weights, plans, same, *pieces in world["plan_on_mesh"]:  # plan_memory, a mesh
        assert plans == [(held, weights)] * 2, (held, weights, plans)
        assert same                  # a bucket at a time: the all-buckets step's bits
        for measured, planned, buckets in pieces:    # what clipping holds more, as planned
            assert measured == planned and measured > 0 and buckets > 1, pieces
    clipped, plain = _reference(STEPS, 0.05), _reference(STEPS, None)
    micro = _reference(4, None)
    numel = sum(t.numel() for t in pytree.tree_leaves(_full()))
    expert = sum(_full()["moe"][k].numel() for k in psf.ExpertShard.SHARDED)
    for out in values:
        for name in ("2x2", "4x1", "1x4"):
            got, reran, held = out[name]
            # fp32; the reduce-scatter orders each sum otherwise than one process's autograd
            assert _gap(got, clipped) < 1e-5, (name, _gap(got, clipped))
        assert _gap(out["micro"], micro) < 1e-5
    assert sum(out["2x2"][1] for out in values) > 0     # some steps reran (flags per ep group)
    # what a rank holds: 12 bytes (fp32 master, two moments) per element of its share,
    # padding of at most one element per parameter and rank
    dense = numel - expert
    for name, ep in (("2x2", 2), ("4x1", 1)):
        share = 12 * (dense / RANKS + expert / RANKS)
        held = values[0][name][2]
        assert share <= held <= share + 12 * 8, (name, held, share)

    # the same checkpoint resumed in one process (every expert, nothing sharded)
    params = _full()
    opt = psf.sharded_optimizer(params, None, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    back = psf.load_checkpoint(tmp_path / "opt", {"params": params, "opt": opt.state_tree()})
    with torch.no_grad():
        for p, q in zip(pytree.tree_leaves(params), pytree.tree_leaves(back["params"])):
            p.copy_(q)
    opt.load_state_tree(back["opt"])
    loss = _loss_of(None)
    for t in range(5, 10):
        grads = torch.func.grad(lambda p: sum(loss(p, _batch(t, r)) for r in range(RANKS)))(
            params)
        opt.step(params, grads)
    assert _gap(pytree.tree_map(lambda t: t.numpy(), params), plain) < 1e-5
    resumed = spawn_world(2, [resume_on_two, mis_sized])
    no_failures(resumed["resume_on_two"])
    for got in resumed["resume_on_two"]:
        assert _gap(got, plain) < 1e-5, _gap(got, plain)
    no_failures(resumed["mis_sized"])
    for rank, (sized, lost, other) in enumerate(resumed["mis_sized"]):
        assert "holds 4 of 8 experts, but the group's ep size is 1" in sized, sized
        assert "holds 4 experts of its router's 8" in lost, lost
        assert ("other tensors" if rank == 0 else "rank 0 refused") in other, other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_process_equals_torch_adamw_on_the_master_weights(dtype):
    """No group: nothing to shard; the same AdamW arithmetic on fp32 master weights as
    torch.optim.AdamW on fp32 copies, the weights their rounding to ``dtype``; clipping as
    torch.nn.utils.clip_grad_norm_ does it (its norm summed in another order: fp32 rounding
    apart, which the weights' rounding to bf16 then hides)."""
    params = pytree.tree_map(lambda t: t.to(dtype), _full())
    master = [t.float().clone() for t in pytree.tree_leaves(params)]
    opt = psf.sharded_optimizer(params, None, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                max_norm=0.5)
    reference = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    for t in range(10):
        g = torch.Generator().manual_seed(t)
        grads = pytree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(dtype), params)
        for m, x in zip(master, pytree.tree_leaves(grads)):
            m.grad = x.float().clone()
        want = torch.nn.utils.clip_grad_norm_(master, 0.5)
        reference.step()
        norm = opt.step(params, grads)
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    for p, m in zip(pytree.tree_leaves(params), master):
        torch.testing.assert_close(p, m.to(dtype), rtol=2e-6 if dtype == torch.float32 else 0,
                                   atol=1e-7 if dtype == torch.float32 else 0)
    with pytest.raises(ValueError, match="other tensors"):
        opt.step(pytree.tree_map(torch.clone, params), grads)


@pytest.mark.parametrize("optimizer,kwargs", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}),
    (torch.optim.NAdam, {"lr": 1e-2}), (torch.optim.AdamW, {"lr": 1e-2, "fused": True})])
def test_a_saved_optimizer_resumes_as_if_uninterrupted(tmp_path, optimizer, kwargs):
    """One process: state saved after 3 steps (0-d state such as NAdam's mu_product with
    it), loaded into a fresh optimizer, 3 more steps: the uninterrupted run's weights."""
    def grads(t, params):
        g = torch.Generator().manual_seed(t)
        return pytree.tree_map(lambda p: torch.randn(p.shape, generator=g), params)

    runs = []
    for stop in (False, True):
        params = _full()
        opt = psf.sharded_optimizer(params, None, optimizer, **kwargs)
        like = opt.state_tree()                  # before any step: the optimizer untouched
        for t in range(6):
            if stop and t == 3:
                psf.save_checkpoint(tmp_path / "opt", opt.state_tree())
                params = _full()                                 # a fresh process
                opt = psf.sharded_optimizer(params, None, optimizer, **kwargs)
                opt.load_state_tree(psf.load_checkpoint(tmp_path / "opt", like))
            opt.step(params, grads(t, params))
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(runs[0]),
                                                 pytree.tree_leaves(runs[1])))


@pytest.mark.parametrize("dtype,max_norm", [(torch.float32, None), (torch.bfloat16, 0.5)])
def test_offloaded_adamw_equals_adamw_on_the_device(monkeypatch, dtype, max_norm):
    """Master weights and moments on the host, stepped a bucket at a time (buckets cut small
    here, so the two-slot ring turns over): over 10 steps, bitwise the fused torch.optim.AdamW
    on fp32 copies of the device's tensors (on the CPU both run the same arithmetic), with
    clipping bitwise the same optimizer not offloaded; a saved state resumes offloaded."""
    import pagedstash_func.parallel._zero as zero
    monkeypatch.setattr(zero, "BUCKET_BYTES", 4 * 200)
    params = pytree.tree_map(lambda t: t.to(dtype), _full())
    plain = pytree.tree_map(torch.clone, params)
    master = [t.float().clone() for t in pytree.tree_leaves(params)]
    kw = dict(lr=1e-2, weight_decay=0.1, max_norm=max_norm)
    opt = psf.sharded_optimizer(params, None, torch.optim.AdamW, offload=True, **kw)
    assert len(opt.buckets) > 2 and all(b.master.device.type == "cpu" for b in opt.buckets)
    assert opt.optimizer.defaults["fused"] is True and opt.pinned_bytes() == 0
    beside = psf.sharded_optimizer(plain, None, torch.optim.AdamW, fused=True, **kw)
    reference = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1, fused=True)
    for t in range(10):
        g = torch.Generator().manual_seed(t)
        grads = pytree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(dtype), params)
        for m, x in zip(master, pytree.tree_leaves(grads)):
            m.grad = x.float().clone()
        reference.step()
        assert (opt.step(params, grads) is None) == (max_norm is None)
        beside.step(plain, grads)
    for p, q, m in zip(pytree.tree_leaves(params), pytree.tree_leaves(plain), master):
        assert torch.equal(p, q)
        if max_norm is None:
            assert torch.equal(p, m.to(dtype))
    assert opt.state_bytes() == beside.state_bytes()
    again = psf.sharded_optimizer(pytree.tree_map(torch.clone, params), None, offload=True, **kw)
    again.load_state_tree(opt.state_tree())
    assert all(torch.equal(a.master, b.master) for a, b in zip(again.buckets, opt.buckets))
    with pytest.raises(ValueError, match="group=None with offload=True"):
        psf.sharded_optimizer(params, object(), offload=True)


def test_offloaded_step_says_where_its_time_went(monkeypatch):
    """`offload_times`: the host's optimizer, casts, waits and copies of the last step, each
    a disjoint part of the host's run on the CPU (so they sum to no more than its wall time);
    a slowed optimizer shows up as optimizer time, a bucket at a time; refused before a step,
    without offload, and after a step that failed part way (its figures are partial)."""
    import time as clock

    import pagedstash_func.parallel._zero as zero
    monkeypatch.setattr(zero, "BUCKET_BYTES", 4 * 200)
    params = _full()
    opt = psf.sharded_optimizer(params, None, offload=True, lr=1e-2)
    with pytest.raises(ValueError, match="no step of this optimizer has finished"):
        opt.offload_times()
    with pytest.raises(ValueError, match="offload=True"):
        psf.sharded_optimizer(pytree.tree_map(torch.clone, params), None).offload_times()
    grads = pytree.tree_map(torch.ones_like, params)
    real = opt.optimizer.step

    def slow():
        clock.sleep(0.02)
        return real()
    monkeypatch.setattr(opt.optimizer, "step", slow)
    opt.step(params, grads)
    times = opt.offload_times()
    assert set(times) == {"wall", "gradients", "optimizer", "cast", "wait", "to_host",
                          "to_device"}
    assert all(v >= 0 for v in times.values()) and times["gradients"] == 0   # CPU: no wait
    parts = sum(v for k, v in times.items() if k != "wall")
    assert parts <= times["wall"]
    assert times["optimizer"] >= 0.02 * len(opt.buckets) and len(opt.buckets) > 2
    assert times["optimizer"] > 0.5 * times["wall"]      # the sleeps, not the copies
    calls = [0]

    def failing():                 # a step that fails in its third bucket
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("out of host memory")
        return real()
    monkeypatch.setattr(opt.optimizer, "step", failing)
    with pytest.raises(RuntimeError, match="out of host memory"):
        opt.step(params, grads)
    with pytest.raises(ValueError, match="the last one failed part way"):
        opt.offload_times()      # not the failed step's partial figures, nor the one before


def test_torchao_8bit_adamw_steps_whole_blocks():
    """torchao's AdamW8bit through the sharded optimizer: each bucket padded to whole blocks
    of 256, so its moments are 8-bit (torchao keeps fp32 ones for a tensor that is not);
    10 steps bitwise AdamW8bit on one flat fp32 vector of the same elements, zero-padded
    alike; its state is refused as a state tree, by name."""
    optim = pytest.importorskip("torchao.optim")
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(3000, generator=g), "b": torch.randn(40, 37, generator=g)}
    opt = psf.sharded_optimizer(params, None, optim.AdamW8bit, lr=1e-2)
    (bucket,) = opt.buckets
    assert bucket.width == 4608 and bucket.width % 256 == 0          # 4480 elements
    flat = torch.zeros(4608)
    flat[:4480] = torch.cat([t.reshape(-1) for t in pytree.tree_leaves(params)])
    reference = optim.AdamW8bit([flat], lr=1e-2)
    for t in range(10):
        gen = torch.Generator().manual_seed(t)
        grads = pytree.tree_map(lambda p: torch.randn(p.shape, generator=gen), params)
        flat.grad = torch.zeros(4608)
        flat.grad[:4480] = torch.cat([x.reshape(-1) for x in pytree.tree_leaves(grads)])
        reference.step()
        opt.step(params, grads)
    assert type(opt.optimizer.state[bucket.master]["exp_avg"]).__name__ == "OptimState8bit"
    assert torch.equal(torch.cat([t.reshape(-1) for t in pytree.tree_leaves(params)]),
                       flat[:4480])
    assert opt.state_bytes() == 4 * 4608 + 2 * (4608 + 4 * 18 + 4 * 256)
    with pytest.raises(ValueError, match="AdamW8bit's quantized state is not one"):
        opt.state_tree()


def test_misuse_is_refused_by_name(monkeypatch):
    """Gradients of another shape or kind, an optimizer class in the group's place or an
    instance in the optimizer's, an empty tree, LBFGS, state trees of another optimizer; and
    a step that fails part way leaves an optimizer that refuses to step until it loads."""
    params = {"a": torch.randn(2, 3), "b": torch.randn(300)}
    opt = psf.sharded_optimizer(params, None, lr=1e-2)
    for bad in ({"a": torch.randn(3, 2), "b": torch.randn(300)},
                {"a": torch.randn(4, 3), "b": torch.randn(300)},
                {"a": torch.zeros(2, 3, dtype=torch.int64), "b": torch.randn(300)}):
        with pytest.raises(ValueError, match=r"grads\['a'\] must be a floating-point tensor"):
            opt.step(params, bad)
    with pytest.raises(ValueError, match="pass the optimizer class as optimizer="):
        psf.sharded_optimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="must be a torch.optim.Optimizer class"):
        psf.sharded_optimizer(params, None, torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(ValueError, match="params hold no tensor"):
        psf.sharded_optimizer({}, None)
    with pytest.raises(ValueError, match="LBFGS steps with a closure"):
        psf.sharded_optimizer(params, None, torch.optim.LBFGS)
    grads = pytree.tree_map(torch.ones_like, params)
    opt.step(params, grads)
    tree = opt.state_tree()
    with pytest.raises(ValueError, match=r"holds \['exp_avg', 'exp_avg_sq', 'master', 'step'\]"):
        opt.load_state_tree({"master": tree["master"]})
    sgd = psf.sharded_optimizer(pytree.tree_map(torch.clone, params), None, torch.optim.SGD,
                                lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="same optimizer class"):
        sgd.load_state_tree(tree)

    class FailsOnSecond(torch.optim.AdamW):
        calls = 0

        def step(self, closure=None):
            FailsOnSecond.calls += 1
            if FailsOnSecond.calls == 2:
                raise RuntimeError("out of memory")
            return super().step(closure)

    import pagedstash_func.parallel._zero as zero
    monkeypatch.setattr(zero, "BUCKET_BYTES", 4 * 100)              # two buckets
    failing = psf.sharded_optimizer(params, None, FailsOnSecond, lr=1e-2)
    assert len(failing.buckets) == 2
    with pytest.raises(RuntimeError, match="out of memory"):
        failing.step(params, grads)
    with pytest.raises(ValueError, match="half-stepped: a step failed after 1 of 2 buckets"):
        failing.step(params, grads)
    failing.load_state_tree(failing.state_tree())         # a loaded state steps again
    failing.step(params, grads)
