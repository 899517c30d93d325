"""Expert parallelism over real ranks (gloo on the CPU): exact and capacity paths against one
process on the concatenated batch, reruns decided on every rank, errors raised on every rank.

One spawned world per module (2 ranks, and 4 for the last test): each rank runs every check
and sends back what it saw; the tests compare. Every wait has a timeout, so a hung collective
fails the test instead of hanging CI.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from worlds import no_failures, spawn_world

import pagedstash_func as psf
from pagedstash_func.parallel import _symmetric

E, H, F, K, T = 8, 16, 12, 2, 24

# ----------------------------------------------------------------------------- the data


def world_data(world, seed=0, skew=None):
    """Full params, every rank's tokens and cotangents (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    full = psf.moe_init(E, H, F, generator=g, dtype=torch.float64)
    xs = torch.randn(world * T, H, generator=g, dtype=torch.float64)
    cot = torch.randn(world * T, H, generator=g, dtype=torch.float64)
    return full, xs, cot


def mine(t, rank):
    return t[rank * T:(rank + 1) * T]


def ep_loss(params, batch):
    ids, w = psf.route(params["router"], batch["x"], K)
    ids = torch.where(batch["pad"][:, None], -1, ids)
    y = psf.moe(params, batch["x"], top_k=K, routing=(ids, w), group=dist.group.WORLD)
    return (y * batch["c"]).sum()


def single_loss(params, batch):
    ids, w = psf.route(params["router"], batch["x"], K)
    ids = torch.where(batch["pad"][:, None], -1, ids)
    return (psf.moe(params, batch["x"], top_k=K, routing=(ids, w)) * batch["c"]).sum()


def batches(rank, world, pad_every=0, bias=None):
    full, xs, cot = world_data(world)
    if bias is not None:
        full["router"] = full["router"] + bias[:, None] * 0     # same shape, same values
    pad = torch.zeros(world * T, dtype=torch.bool)
    if pad_every:
        pad[::pad_every] = True
    whole = {"x": xs, "c": cot, "pad": pad}
    return full, {k: mine(v, rank) for k, v in whole.items()}, whole


def compare_to_single(rank, world, grads, full, whole):
    """Largest error of EP grads against one process (router summed over ranks)."""
    ref = torch.func.grad(single_loss)(full, whole)
    per = E // world
    errs = [(grads[n] - ref[n][rank * per:(rank + 1) * per]).abs().max().item()
            for n in ("w_gate_up", "w_down")]
    router = grads["router"].clone()
    dist.all_reduce(router)
    return max(errs + [(router - ref["router"]).abs().max().item()])


# ----------------------------------------------------------------------------- checks


def exact_matches_single_process(rank, world):
    full, batch, whole = batches(rank, world, pad_every=5)
    params = psf.shard_experts(full, dist.group.WORLD)
    y = psf.moe(params, batch["x"], top_k=K, group=dist.group.WORLD)
    y_err = (y - mine(psf.moe(full, whole["x"], top_k=K), rank)).abs().max().item()
    grads = torch.func.grad(ep_loss)(params, batch)
    return max(y_err, compare_to_single(rank, world, grads, full, whole))


def run_step_capacity_stash_matches(rank, world, pool_scope="state"):
    full, batch, whole = batches(rank, world, pad_every=3)
    params = psf.shard_experts(full, dist.group.WORLD)
    step = psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=float(world * 2),
                                                    paged_stash=True, page_size=8,
                                                    pool_scope=pool_scope))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    free = all(v["cuda_used"] == 0 for v in psf.pages_in_use(res.state).values())
    psf.validate_state(res.state, between_steps=True)     # every table gave its pages back
    return (res.report.reran, compare_to_single(rank, world, res.grads, full, whole), free,
            res.report.layers[0].rank_load)


def layer_pools_match(rank, world):
    """pool_scope="layer" across ranks (the fc1 input and gate_up in pools of the layer's own,
    the fc1 input copied on the side stream's path): the same answer, every page back."""
    return run_step_capacity_stash_matches(rank, world, pool_scope="layer")


def copies_are_told_the_rows_to_expect(rank, world):
    """The fc1 input's stash and pop across ranks size their grids for T * k rows (what one
    rank receives under even routing): the ``expected_rows`` each call passes."""
    from pagedstash_func import kernels
    full, batch, _ = batches(rank, world)
    params = psf.shard_experts(full, dist.group.WORLD)
    step = psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=float(world * 2),
                                                    paged_stash=True, page_size=8))
    seen, ops = [], {name: getattr(kernels, name) for name in ("stash_copy", "stash_pop")}
    for name, op in ops.items():
        setattr(kernels, name, lambda *a, name=name, op=op: seen.append((name, a[-1])) or op(*a))
    try:
        psf.run_step(step, params, batch, step.init(params, batch))
    finally:
        for name, op in ops.items():
            setattr(kernels, name, op)
    return seen


def layer_pools_go_after_their_last_reader(rank, world, cuda_factor=1.1):
    """pool_scope="layer" across ranks, both stashed tensors paged: at the layer's two
    weight-gradient GEMMs, which pools are alive. gate_up's pool goes once the SwiGLU backward
    has read it (before the first), the fc1 input's once it is popped (before the second).
    With a ``cuda_factor`` whose pools would hold the whole buffers, the buffers are kept
    instead, and go at the same points."""
    import weakref

    import pagedstash_func.experts._experts as experts
    full, batch, whole = batches(rank, world, pad_every=3)
    params = psf.shard_experts(full, dist.group.WORLD)
    step = psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=float(world * 2),
                                                    paged_stash=True, page_size=8,
                                                    cuda_factor=cuda_factor,
                                                    pool_scope="layer"))
    state = step.init(params, batch)
    _, pullback, new_state = torch.func.vjp(lambda p: step(p, batch, state), params,
                                            has_aux=True)
    (record,) = new_state.pending
    held = {f"{record.layer}/{n}": t for n, t in record.buffers.items()}
    held.update({n: slot.cuda for n, slot in record.private.items()})
    names = sorted(held)
    refs = [weakref.ref(held[n]) for n in names]
    del record, held
    seen, wgrad = [], experts.grouped_mm_wgrad

    def noting_wgrad(*args, **kw):
        seen.append([r() is not None for r in refs])
        return wgrad(*args, **kw)
    experts.grouped_mm_wgrad = noting_wgrad
    try:
        grads = pullback(torch.ones((), dtype=torch.float64))[0]
    finally:
        experts.grouped_mm_wgrad = wgrad
    return names, seen, compare_to_single(rank, world, grads, full, whole)


def kept_buffers_go_after_their_last_reader(rank, world):
    """As above with pools that would hold the whole buffers (cuda_factor 2.5 against buffers
    of 2 x T*k rows): nothing is paged, the buffers are kept and let go at the same points."""
    return layer_pools_go_after_their_last_reader(rank, world, cuda_factor=2.5)


def skew_over_budget_reruns_every_rank(rank, world):
    full, batch, whole = batches(rank, world)
    # every token of rank 0 to experts 0 and 1 (rank 0's experts): over budget there only
    def skewed(params, b):
        ids, w = psf.route(params["router"], b["x"], K)
        if dist.get_rank() == 0:
            ids = torch.stack([torch.zeros(T, dtype=torch.int64),
                               torch.ones(T, dtype=torch.int64)], 1)
        y = psf.moe(params, b["x"], top_k=K, routing=(ids, w), group=dist.group.WORLD)
        return (y * b["c"]).sum()

    params = psf.shard_experts(full, dist.group.WORLD)
    step = psf.stash_aware(skewed, psf.StashConfig(capacity_factor=1.0, paged_stash=True,
                                                   page_size=8))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    exact = torch.func.grad(skewed)(params, batch)
    err = max((res.grads[n] - exact[n]).abs().max().item() for n in exact)
    return res.report.reran, res.report.over_budget, err, res.report.flagged_by


def undersized_pool_on_one_rank_reruns_all(rank, world):
    full, batch, whole = batches(rank, world)
    params = psf.shard_experts(full, dist.group.WORLD)
    cuda_factor = 0.05 if rank == 1 else 2.0
    step = psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=float(world * 2),
                                                    paged_stash=True, page_size=8,
                                                    cuda_factor=cuda_factor))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    return (res.report.reran, res.report.overflow,
            compare_to_single(rank, world, res.grads, full, whole), res.report.flagged_by)


def bit_for_bit_run_to_run(rank, world):
    """Two runs from equal states, and a replay of each rank's own step file, give the same
    bits."""
    import tempfile
    full, batch, _ = batches(rank, world, pad_every=4)
    params = psf.shard_experts(full, dist.group.WORLD)
    step = psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=1.5, paged_stash=True,
                                                    page_size=8))
    state = step.init(params, batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/rank{rank}.pt"
        psf.save_step(path, step, params, batch, state)
        twin = state.clone()
        a = psf.run_step(step, params, batch, state)
        b = psf.run_step(step, params, batch, twin)
        c = psf.replay_step(path, ep_loss)
    return all(torch.equal(a.grads[n], b.grads[n]) and torch.equal(a.grads[n], c.grads[n])
               for n in a.grads) and torch.equal(a.loss, b.loss) and torch.equal(a.loss, c.loss)


def bad_inputs_raise_on_every_rank(rank, world):
    full, batch, _ = batches(rank, world)
    group = dist.group.WORLD
    params = psf.shard_experts(full, group)
    seen = []
    for case in ("ranks", "unsharded", "tokens", "indivisible", "other_group", "factor"):
        try:
            if case == "factor":        # ranks that disagree on the capacity factor
                cf = 1.0 if rank == 0 else 1.5
                psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=cf)).init(params, batch)
            elif case == "indivisible":
                psf.shard_experts(psf.moe_init(7, H, F, dtype=torch.float64), group)
            elif case == "other_group":
                other = psf.ExpertShard(params, w_gate_up=params["w_gate_up"][:2],
                                        w_down=params["w_down"][:2])
                psf.moe(other, batch["x"], top_k=K, group=group)
            elif case == "ranks":
                step = psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=1.0,
                                                                expert_ranks=world + 1))
                step.init(params, batch)
            elif case == "unsharded":
                psf.moe(full if rank == 0 else params, batch["x"], top_k=K, group=group)
            else:
                short = {k: v[:T - rank] for k, v in batch.items()}
                psf.stash_aware(ep_loss, psf.StashConfig(capacity_factor=1.0)).init(params,
                                                                                     short)
            seen.append((case, "no error"))
        except ValueError as err:
            seen.append((case, str(err).split(":")[0][:60]))
    return seen


def plain_dict_shards_are_refused(rank, world):
    """all_reduce_replicated on a plain dict made from a shard (its record lost) refuses it on
    every rank, before any collective, naming it; the gradients of an ExpertShard leave the
    shards alone and sum the router."""
    full, batch, whole = batches(rank, world)
    shard = psf.shard_experts(full, dist.group.WORLD)
    grads = torch.func.grad(ep_loss)(dict(shard), batch)          # a plain dict now
    try:
        psf.all_reduce_replicated({k: v.clone() for k, v in grads.items()}, dist.group.WORLD)
        said = ""
    except ValueError as err:
        said = str(err)
    summed = psf.all_reduce_replicated(psf.ExpertShard({k: v.clone() for k, v in grads.items()}),
                                       dist.group.WORLD)
    return said, torch.equal(summed["w_down"], grads["w_down"]) and \
        not torch.equal(summed["router"], grads["router"])


def vdev_on_gloo(send, recv, in_splits, out_splits, group_name):
    """``torch.ops.symm_mem.all_to_all_vdev``'s contract on gloo (host-read splits): rows
    packed by destination out of ``send``, packed by source into ``recv``; rows of ``recv``
    past the received ones keep what was there."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    group = _resolve_process_group(group_name)        # a sub-group too (an ep group)
    received = torch.empty_like(in_splits)
    dist.all_to_all_single(received, in_splits.clone(), group=group)
    got = send.new_empty(int(received.sum()), send.shape[1])
    dist.all_to_all_single(got, send[:int(in_splits.sum())].contiguous(), received.tolist(),
                           in_splits.tolist(), group=group)
    recv[:got.shape[0]] = got
    out_splits[0], out_splits[1] = received, received.cumsum(0) - received


class WorkspaceOnGloo(_symmetric.Workspace):
    """The real NVSHMEM workspace (reserve, growth, send views, padded strides, masking) in
    CPU memory that starts as garbage bytes (0x7F: NaN in floats, a huge expert id), so a plan
    that read a row nobody sent would give wrong bits here."""

    def __init__(self, group):
        super().__init__(group, device=torch.device("cpu"))

    def _symmetric(self, *shape, dtype):
        t = torch.empty(*shape, dtype=dtype)
        t.view(-1).view(torch.uint8).fill_(0x7F)
        return t


class EmulatedNvshmem:
    """``with EmulatedNvshmem():`` the NVSHMEM transport runs on gloo (only the op emulated)."""

    def __enter__(self):
        self.saved = _symmetric.workspace, _symmetric.unavailable, _symmetric.all_to_all_vdev
        spaces = {}

        def workspace(group):
            return spaces.setdefault(_symmetric._group_name(group), WorkspaceOnGloo(group))
        _symmetric.workspace, _symmetric.unavailable = workspace, (lambda group: None)
        _symmetric.all_to_all_vdev = vdev_on_gloo
        return self

    def __exit__(self, *exc):
        _symmetric.workspace, _symmetric.unavailable, _symmetric.all_to_all_vdev = self.saved


def transports_give_the_same_bits(rank, world):
    """Fixed slots against the NVSHMEM transport (its op emulated on gloo): the same bits for
    attempts that keep everything and for attempts that drop (cf 0.5), under skew (every token
    of rank 0 to the last rank's experts) and padding, and run_step equal to one process."""
    full, batch, whole = batches(rank, world, pad_every=4)
    params = psf.shard_experts(full, dist.group.WORLD)
    same, over, err = [], [], 0.0

    def skewed(p, b):
        ids, w = psf.route(p["router"], b["x"], K)
        if dist.get_rank() == 0:
            ids = (E - 1 - ids % (E // world))                 # the last rank's experts
        ids = torch.where(b["pad"][:, None], -1, ids)
        return (psf.moe(p, b["x"], top_k=K, routing=(ids, w), group=dist.group.WORLD)
                * b["c"]).sum()

    with EmulatedNvshmem():
        for loss_fn, cf in ((ep_loss, float(world * 2)), (ep_loss, 0.5), (skewed, 1.0)):
            outs = []
            for transport in ("fixed", "nvshmem"):
                cfg = psf.StashConfig(capacity_factor=cf, paged_stash=True, page_size=8,
                                      transport=transport)
                step = psf.stash_aware(loss_fn, cfg)
                attempt = torch.func.grad_and_value(step.attempt, has_aux=True)
                grads, (loss, state) = attempt(params, batch, step.init(params, batch))
                outs.append((grads, loss, psf.read_flags(state)["over_budget"]))
                if cf > 1:
                    res = psf.run_step(step, params, batch, step.init(params, batch))
                    err = max(err, compare_to_single(rank, world, res.grads, full, whole))
            (g0, l0, o0), (g1, l1, o1) = outs
            same.append(torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0))
            over.append((o0, o1))
    return same, over, err


def padded_rows_same_bits(rank, world):
    """Rows of 80 bytes (fp32, H = 20) travel in 128-byte strides: the same bits as fixed
    slots."""
    group = dist.group.WORLD
    full = psf.moe_init(E, 20, F, generator=torch.Generator().manual_seed(0))
    params = psf.shard_experts(full, group)
    gen = torch.Generator().manual_seed(1 + rank)
    batch = {"x": torch.randn(T, 20, generator=gen), "c": torch.randn(T, 20, generator=gen)}

    def loss_fn(p, b):
        return (psf.moe(p, b["x"], top_k=K, group=group) * b["c"]).sum()

    outs = []
    with EmulatedNvshmem():
        for transport in ("fixed", "nvshmem"):
            step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.0,
                                                            transport=transport))
            attempt = torch.func.grad_and_value(step.attempt, has_aux=True)
            outs.append(attempt(params, batch, step.init(params, batch)))
    (g0, (l0, _)), (g1, (l1, _)) = outs
    return torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def transport_refusals(rank, world):
    """Asking for NVSHMEM over gloo, a bad $PAGEDSTASH_TRANSPORT, or ranks that resolve
    different transports: refused on every rank at init (before any collective allocation)."""
    import os
    full, batch, _ = batches(rank, world)
    params = psf.shard_experts(full, dist.group.WORLD)
    seen = [("available", psf.available_transports(dist.group.WORLD))]
    with EmulatedNvshmem():
        seen.append(("emulated", psf.available_transports(dist.group.WORLD)))
    for case in ("nvshmem", "env", "disagree"):
        cfg = psf.StashConfig(capacity_factor=1.0, transport="nvshmem" if case == "nvshmem"
                              else "auto")
        if case == "env" and rank == 1:
            os.environ["PAGEDSTASH_TRANSPORT"] = "nvlink"
        if case == "disagree":
            os.environ["PAGEDSTASH_TRANSPORT"] = "nvshmem" if rank == 0 else "fixed"
        try:
            with EmulatedNvshmem() if case == "disagree" else contextlib.nullcontext():
                psf.stash_aware(ep_loss, cfg).init(params, batch)
            seen.append((case, "no error"))
        except ValueError as err:
            seen.append((case, str(err)))
        finally:
            os.environ.pop("PAGEDSTASH_TRANSPORT", None)
    return seen


CHECKS = [exact_matches_single_process, run_step_capacity_stash_matches,
          skew_over_budget_reruns_every_rank, undersized_pool_on_one_rank_reruns_all,
          bit_for_bit_run_to_run, bad_inputs_raise_on_every_rank,
          plain_dict_shards_are_refused, transports_give_the_same_bits,
          padded_rows_same_bits, transport_refusals, layer_pools_match,
          layer_pools_go_after_their_last_reader, kept_buffers_go_after_their_last_reader,
          copies_are_told_the_rows_to_expect]


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_world(2, CHECKS)


def test_exact_path_equals_one_process(two_ranks):
    no_failures(two_ranks["exact_matches_single_process"])
    assert max(two_ranks["exact_matches_single_process"]) < 1e-12


def test_run_step_with_capacity_and_stash_equals_one_process(two_ranks):
    values = two_ranks["run_step_capacity_stash_matches"]
    no_failures(values)
    for reran, err, free, rank_load in values:
        assert not reran and err < 1e-12 and free
    assert values[0][3] == values[1][3]      # rank loads are global: the same on every rank


def test_copies_across_ranks_are_told_the_rows_to_expect(two_ranks):
    values = two_ranks["copies_are_told_the_rows_to_expect"]
    no_failures(values)
    for seen in values:
        assert sorted(seen) == [("stash_copy", T * K), ("stash_pop", T * K)]


def test_layer_pools_across_ranks_equal_one_process(two_ranks):
    values = two_ranks["layer_pools_match"]
    no_failures(values)
    for reran, err, free, _ in values:
        assert not reran and err < 1e-12 and free


@pytest.mark.parametrize("check, at_last_gemm", [
    ("layer_pools_go_after_their_last_reader", [False, False]),    # popped into a new buffer
    ("kept_buffers_go_after_their_last_reader", [False, True])])   # the kept buffer is read
def test_layer_pools_go_as_soon_as_they_are_read_across_ranks(two_ranks, check, at_last_gemm):
    values = two_ranks[check]
    no_failures(values)
    for names, seen, err in values:
        assert names == ["moe0/act_in", "moe0/fc1_in"]
        assert seen == [[False, True], at_last_gemm]     # at d_w_down, at d_w_gate_up
        assert err < 1e-12


def test_one_destination_over_budget_reruns_every_rank(two_ranks):
    values = two_ranks["skew_over_budget_reruns_every_rank"]
    no_failures(values)
    for reran, over, err, flagged_by in values:
        assert reran and over and err < 1e-12
        assert flagged_by == (0, 1)    # both ranks see rank 0's destination over budget


def test_undersized_pool_on_one_rank_reruns_all(two_ranks):
    values = two_ranks["undersized_pool_on_one_rank_reruns_all"]
    no_failures(values)
    for reran, overflow, err, flagged_by in values:
        assert reran and overflow and err < 1e-12 and flagged_by == (1,)


def test_run_to_run_bitwise(two_ranks):
    no_failures(two_ranks["bit_for_bit_run_to_run"])
    assert all(v is True for v in two_ranks["bit_for_bit_run_to_run"])


def test_replicated_gradients_are_summed_and_a_shard_without_its_record_refused(two_ranks):
    values = two_ranks["plain_dict_shards_are_refused"]
    no_failures(values)
    assert all("holds 4 experts of its router's 8" in said and summed is True
               for said, summed in values), values


def test_bad_input_raises_on_every_rank(two_ranks):
    values = two_ranks["bad_inputs_raise_on_every_rank"]
    no_failures(values)
    want = {"ranks": "expert_ranks=3 but the experts are spread over a group of 2",
            "tokens": "the ranks built their expert-parallel layers differently (['budget', "
                      "'capacity', 'tokens']",
            "factor": "the ranks built their expert-parallel layers differently (['budget', "
                      "'capacity']",
            "indivisible": "7 experts do not split over 2 ranks",
            "other_group": "the router has 8 rows but w_gate_up holds 2 experts on each"}
    for rank, seen in enumerate(values):
        got = dict(seen)
        for case, text in want.items():
            assert got[case].startswith(text[:60]), (rank, case, got[case])
    # the rank that passed unsharded params names the fix; the other says who refused
    assert dict(values[0])["unsharded"].startswith("with a group of 2 ranks each rank holds")
    assert dict(values[1])["unsharded"].startswith("rank 0 refused its psf.moe call")


def test_transports_give_the_same_bits(two_ranks):
    values = two_ranks["transports_give_the_same_bits"]
    no_failures(values)
    for same, over, err in values:
        assert same == [True, True, True] and err < 1e-12
        assert over == [(False, False), (True, True), (True, True)]   # cf 0.5 and skew drop
    no_failures(two_ranks["padded_rows_same_bits"])
    assert all(v is True for v in two_ranks["padded_rows_same_bits"])


def test_transport_refusals_on_every_rank(two_ranks):
    values = two_ranks["transport_refusals"]
    no_failures(values)
    for rank, seen in enumerate(values):
        got = dict(seen)
        assert got["available"] == ("fixed",) and got["emulated"] == ("nvshmem", "fixed")
        assert got["nvshmem"].startswith("transport 'nvshmem' (StashConfig(transport="
                                         "'nvshmem')) cannot run here: the group's backend is "
                                         "'gloo'"), got["nvshmem"]
        if rank == 1:
            assert got["env"].startswith("$PAGEDSTASH_TRANSPORT='nvlink'"), got["env"]
        else:
            assert got["env"].startswith("rank 1 refused its transport"), got["env"]
        assert got["disagree"].startswith("the ranks resolved different transports (['nvshmem', "
                                          "'fixed'], one per rank)"), got["disagree"]


def padding_both_spellings(rank, world):
    """ids -1 and E are padding in EP too: the same bits as dropping those pairs by hand."""
    full, batch, whole = batches(rank, world)
    params = psf.shard_experts(full, dist.group.WORLD)
    ids, w = psf.route(params["router"], batch["x"], K)
    mask = torch.arange(T)[:, None] % 3 == 0
    grads = []
    for pad in (-1, E):
        def loss(p, b, pad=pad):
            routed = torch.where(mask, pad, ids)
            return (psf.moe(p, b["x"], top_k=K, routing=(routed, w), group=dist.group.WORLD)
                    * b["c"]).sum()
        grads.append(torch.func.grad(loss)(params, batch))
    return all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.fixture(scope="module")
def four_ranks():
    return spawn_world(4, [exact_matches_single_process, run_step_capacity_stash_matches,
                           skew_over_budget_reruns_every_rank, padding_both_spellings,
                           transports_give_the_same_bits])


def test_four_ranks(four_ranks):
    for values in four_ranks.values():
        no_failures(values)
    assert max(four_ranks["exact_matches_single_process"]) < 1e-12
    for reran, err, free, _ in four_ranks["run_step_capacity_stash_matches"]:
        assert not reran and err < 1e-12 and free
    for reran, over, err, flagged_by in four_ranks["skew_over_budget_reruns_every_rank"]:
        assert reran and over and err < 1e-12 and flagged_by == (0, 1, 2, 3)
    assert all(four_ranks["padding_both_spellings"])
    for same, over, err in four_ranks["transports_give_the_same_bits"]:
        assert same == [True, True, True] and err < 1e-12 and over[1] == (True, True)
