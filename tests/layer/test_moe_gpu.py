"""On CUDA only: the capacity path never syncs, bf16 stays close to fp32, graphs replay."""

import pytest
import torch
from sync_free import without_sync

import pagedstash_func as psf

pytestmark = pytest.mark.gpu

T, H, F, E, K = 512, 256, 192, 16, 4


def setup(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = psf.moe_init(E, H, F, generator=g, dtype=dtype, device="cuda")
    x = torch.randn(T, H, generator=g).to("cuda", dtype)
    return params, x


def capacity_step(cfg, pad=False):
    """One capacity layer; ``pad``: every third token is padding (id -1), so that a pool of
    the layer's own smaller than its buffer (``cuda_factor`` 0.75) still holds every valid
    row and is paged (without padding such a pool would overflow, and one that fits is kept
    whole: `_pools.kept_whole`)."""
    def step(params, x, state):
        routing = None
        if pad:
            ids, w = psf.route(params["router"], x, K)
            padding = torch.arange(T, device="cuda") % 3 == 0
            routing = (torch.where(padding[:, None], -1, ids), w)
        y, state = psf.moe_capacity(params, x, state, layer="l0", top_k=K, cfg=cfg,
                                    routing=routing)
        return (y.float() * torch.linspace(-1, 1, H, device="cuda")).sum(), (y, state)
    return step



def new_state(params, cfg):
    specs = psf.moe_stash_specs("l0", params, tokens=T, top_k=K, cfg=cfg)
    return psf.init_stash_state(specs, cfg, device="cuda", counts={"l0/expert_load": E})


@pytest.mark.parametrize("host_factor,scope,cuda_factor", [
    (0.0, "state", 1.1), (1.0, "state", 0.5), (0.0, "layer", 1.1), (0.0, "layer", 0.75)])
def test_capacity_path_forward_and_backward_do_not_sync(host_factor, scope, cuda_factor):
    """(A pool of the layer's own at cuda_factor 1.1 is kept whole, at 0.75 with padding
    paged.)"""
    params, x = setup()
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=True, expert_ranks=4,
                          cuda_factor=cuda_factor, host_factor=host_factor, pool_scope=scope)
    state = new_state(params, cfg)
    grad = torch.func.grad(capacity_step(cfg, pad=cuda_factor < 1 and not host_factor),
                           has_aux=True)
    grad(params, x, state.clone())            # warm up: Triton compiles, cuBLAS handles
    grads, (y, state) = without_sync(grad, params, x, state)
    flags = psf.read_flags(state)
    assert not flags["overflow"] and flags["host_spill"] == bool(host_factor)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("capacity_factor,host_factor,scope,cuda_factor",
                         [(1.25, 0.0, "state", 1.1), (1.25, 1.0, "state", 0.4),
                          (0.6, 0.0, "state", 1.1), (1.25, 0.0, "layer", 1.1),
                          (0.6, 0.0, "layer", 1.1), (1.25, 0.0, "layer", 0.75)])
def test_stash_gives_the_bits_of_no_stash(capacity_factor, host_factor, scope, cuda_factor):
    """The fused SwiGLU kernels write gate_up's pages (device and host, in the shared pool or
    the layer's own) and read them back, or the layer keeps its buffer whole (a pool of its
    own at cuda_factor 1.1): values and gradients equal the unstashed capacity path's bit for
    bit, with drops and padding too."""
    params, x = setup(seed=4)
    pad = scope == "layer" and cuda_factor < 1
    out = []
    for stash in (False, True):
        cfg = psf.StashConfig(capacity_factor=capacity_factor, paged_stash=stash,
                              expert_ranks=4, cuda_factor=cuda_factor,
                              host_factor=host_factor, pool_scope=scope)
        grads, (y, state) = torch.func.grad(capacity_step(cfg, pad), has_aux=True)(
            params, x, new_state(params, cfg))
        out.append((grads, y, psf.read_flags(state)))
    (g0, y0, _), (g1, y1, flags) = out
    if scope == "layer":        # which of the two ways this case takes
        from pagedstash_func.stash._pools import kept_whole
        rows = psf.capacity_rows(T, K, cfg).rows
        assert kept_whole(state.layer_pools["l0/act_in"], rows) == (cuda_factor >= 1)
    assert flags["host_spill"] == bool(host_factor) and not flags["overflow"]
    assert torch.equal(y0, y1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_bf16_capacity_and_stash_close_to_fp32_exact():
    params, x = setup()
    params32 = {k: v.float() for k, v in params.items()}
    cfg = psf.StashConfig(capacity_factor=2.0, paged_stash=True, expert_ranks=2)
    grads, (y, state) = torch.func.grad(capacity_step(cfg), has_aux=True)(
        params, x, new_state(params, cfg))
    assert not any(psf.read_flags(state).values())

    def exact(p):
        y = psf.moe(p, x.float(), top_k=K)
        return (y * torch.linspace(-1, 1, H, device="cuda")).sum(), y
    grads32, y32 = torch.func.grad(exact, has_aux=True)(params32)

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()
    assert rel(y, y32) < 2e-2
    for name in grads:
        assert torch.isfinite(grads[name]).all()
        assert rel(grads[name], grads32[name]) < 3e-2, name


def test_bf16_exact_path_uses_grouped_mm_and_matches_fp32():
    params, x = setup(seed=1)
    y = psf.moe(params, x, top_k=K)
    y32 = psf.moe({k: v.float() for k, v in params.items()}, x.float(), top_k=K)
    assert ((y.float() - y32).norm() / y32.norm()) < 2e-2


def test_fp32_on_cuda_is_correct():
    params, x = setup(dtype=torch.float32, seed=2)
    cfg = psf.StashConfig(capacity_factor=4.0, paged_stash=True)
    (g, (y, _)) = torch.func.grad(capacity_step(cfg), has_aux=True)(params, x,
                                                                   new_state(params, cfg))
    torch.testing.assert_close(y, psf.moe(params, x, top_k=K), rtol=1e-4, atol=1e-4)


def test_capacity_grad_step_captures_in_a_cuda_graph():
    params, x = setup(seed=3)
    cfg = psf.StashConfig(capacity_factor=1.5, paged_stash=True, expert_ranks=2)
    state = new_state(params, cfg)
    grad = torch.func.grad(capacity_step(cfg), has_aux=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            grad(params, x, state.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads, (y, out_state) = grad(params, x, state)
    for seed in (10, 11):
        x.copy_(torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to("cuda",
                                                                                    x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        want_grads, (want_y, _) = grad(params, x, new_state(params, cfg))
        assert torch.equal(y, want_y)
        for name in grads:
            assert torch.equal(grads[name], want_grads[name]), name
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(out_state).values())


def test_moe_init_draws_on_a_cuda_generator():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = psf.moe_init(E, H, F, generator=g, device="cuda")
    b = psf.moe_init(E, H, F, generator=torch.Generator(device="cuda").manual_seed(0),
                     device="cuda")
    assert a["w_down"].is_cuda and all(torch.equal(a[n], b[n]) for n in a)


def test_router_options_shared_expert_and_stats_do_not_sync_and_equal_the_exact_path():
    """A sigmoid, group-limited router with a bias and scaling, a gated shared expert and a
    Switch loss from the layer's statistics: the capacity attempt (forward and backward, the
    lean gradient path) reads nothing on the host, and run_step's loss and gradients equal
    the exact path's to bf16 rounding."""
    params, x = setup(seed=5)
    g = torch.Generator().manual_seed(6)
    params["router_bias"] = (torch.randn(E, generator=g) * 0.1).cuda()
    params["shared_gate_up"] = (torch.randn(H, 2 * 96, generator=g) / 16).to("cuda", x.dtype)
    params["shared_down"] = (torch.randn(96, H, generator=g) / 10).to("cuda", x.dtype)
    params["shared_gate"] = (torch.randn(1, H, generator=g) / 16).to("cuda", x.dtype)
    router = psf.Router(scores="sigmoid", groups=4, groups_kept=2, scale=2.5,
                        logits_dtype=torch.float32)

    def loss(p, b):
        y, stats = psf.moe(p, b, top_k=K, router=router, return_stats=True)
        return y.float().square().mean() + 0.01 * psf.switch_loss(stats) \
            + 1e-3 * psf.z_loss(stats)

    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=1.25, paged_stash=True,
                                                 expert_ranks=4))
    state = step.init(params, x)
    grad = psf.value_and_grad(step.attempt, has_aux=True)
    _, (_, state) = grad(params, x, state)             # warm up
    grads, (value, state) = without_sync(grad, params, x, state)
    assert all(torch.isfinite(t).all() for t in grads.values())
    res = psf.run_step(step, params, x, state)
    ref_grads, ref = torch.func.grad_and_value(loss)(params, x)
    torch.testing.assert_close(res.loss, ref, rtol=2e-2, atol=1e-3)
    for name in ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_gate"):
        err = (res.grads[name].float() - ref_grads[name].float()).abs().max()
        assert err <= 2e-2 * ref_grads[name].float().abs().max() + 1e-6, name


def test_rms_norm_kernels_on_cuda_equal_the_formula_and_do_not_sync():
    g = torch.Generator().manual_seed(7)
    for rows, width in ((4096, 2048), (300, 128), (17, 7168)):
        x = torch.randn(rows, width, generator=g).to("cuda", torch.bfloat16).requires_grad_()
        w = (1 + 0.1 * torch.randn(width, generator=g)).to("cuda", torch.bfloat16)
        w.requires_grad_()
        dy = torch.randn(rows, width, generator=g).to("cuda", torch.bfloat16)
        xf = x.double()
        ref = w.double() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
        ref_dx, ref_dw = torch.autograd.grad(ref, [x, w], dy.double())
        psf.rms_norm(x, w)                       # compile
        y = without_sync(psf.rms_norm, x, w)
        dx, dw = without_sync(torch.autograd.grad, y, [x, w], dy)
        for got, want in ((y, ref), (dx, ref_dx), (dw, ref_dw)):
            err = (got.double() - want).abs().max()
            assert err <= 2e-2 * want.abs().max(), (rows, width)


@pytest.mark.parametrize("scope,cuda_factor", [("state", 1.1), ("layer", 1.1)])
def test_fp8_stash_does_not_sync_and_replays_from_a_graph_bit_for_bit(scope, cuda_factor):
    """The float8 stash (paged in a shared pool, kept whole in a pool of its own): no host
    read in the attempt, a graph replay gives eager's bits, gradients within float8's
    rounding of the bf16 stash's."""
    params, x = setup(seed=8)
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=True, expert_ranks=4,
                          pool_scope=scope, cuda_factor=cuda_factor, stash_precision="fp8")

    def loss(p, b):
        return (psf.moe(p, b, top_k=K).float() * torch.linspace(-1, 1, H, device="cuda")).sum()

    step = psf.stash_aware(loss, cfg)
    state = step.init(params, x)
    attempt = psf.value_and_grad(step.attempt, has_aux=True)
    _, (_, state) = attempt(params, x, state)
    _, (_, state) = without_sync(attempt, params, x, state)
    eager = psf.run_step(step, params, x, state)
    gstep = psf.graphed(step)
    g = gstep(params, x, eager.state)
    g = gstep(params, x, g.state)
    assert torch.equal(g.loss, eager.loss)
    assert all(torch.equal(a, b) for a, b in zip(g.grads.values(), eager.grads.values()))
    plain = psf.stash_aware(loss, psf.StashConfig(capacity_factor=1.25, paged_stash=True,
                                                  expert_ranks=4, pool_scope=scope,
                                                  cuda_factor=cuda_factor))
    ref = psf.run_step(plain, params, x, plain.init(params, x))
    for k in ("w_gate_up", "w_down", "router"):
        err = (eager.grads[k].float() - ref.grads[k].float()).norm() / ref.grads[k].float().norm()
        assert 0 < err < 0.06, k
