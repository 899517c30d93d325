"""The chunked LM head loss against torch's cross-entropy on the full logits."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from pagedstash_func.interop._lm_loss import lm_loss


def reference(hidden, weight, targets):
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, targets,
                                             ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_loss_and_gradients_equal_full_logits(chunk, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=dtype)
    weight = torch.randn(50, 16, generator=g, dtype=dtype)
    targets = torch.randint(0, 50, (37,), generator=g)
    targets[::5] = -100
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    ours = torch.func.grad_and_value(lambda h, w: lm_loss(h, w, targets, chunk),
                                     argnums=(0, 1))(hidden, weight)
    theirs = torch.func.grad_and_value(lambda h, w: reference(h, w, targets),
                                       argnums=(0, 1))(hidden, weight)
    torch.testing.assert_close(ours[1].double(), theirs[1].double(), rtol=tol, atol=tol)
    for a, b in zip(ours[0], theirs[0]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (3.0 * lm_loss(h, w, targets, chunk)).backward()          # plain autograd, scaled
    torch.testing.assert_close(h.grad, 3.0 * theirs[0][0], rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad, 3.0 * theirs[0][1], rtol=tol, atol=tol)


def test_without_gradients_it_computes_the_loss_only():
    hidden, weight = torch.randn(9, 4), torch.randn(11, 4)
    targets = torch.randint(0, 11, (9,))
    with torch.no_grad():
        torch.testing.assert_close(lm_loss(hidden, weight, targets, 2),
                                   reference(hidden, weight, targets))


def test_no_target_gives_nan_as_transformers_does():
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    assert torch.isnan(lm_loss(hidden, weight, torch.full((3,), -100), 2))


def test_bf16_gradients_scaled_in_fp32_round_once():
    """A scale other than 1 (loss scaling, accumulation weights) multiplies in fp32 and rounds
    once, as transformers' own backward does."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(33, 16, generator=g).bfloat16()
    weight = torch.randn(40, 16, generator=g).bfloat16()
    targets = torch.randint(0, 40, (33,), generator=g)
    ours = torch.func.grad(lambda h, w: lm_loss(h, w, targets, 8) / 3, argnums=(0, 1))(
        hidden, weight)
    ref = torch.func.grad(lambda h, w: reference(h.double(), w.double(), targets) / 3,
                          argnums=(0, 1))(hidden, weight)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.bfloat16
        assert ((a.double() - b).norm() / b.norm()) < 1e-2
    with pytest.raises(ValueError, match="positive number of rows"):
        lm_loss(hidden, weight, targets, -3)


def test_create_graph_through_the_loss_is_refused():
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(7, 4, requires_grad=True)
    loss = lm_loss(hidden, weight, torch.randint(0, 7, (5,)), 2)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(loss, hidden, create_graph=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_it_runs_as_one_op_with_eagers_bits(dtype):
    """Compiled whole, the chunk loop stays one op (`lm_loss_with_grads`): the same kernels
    as eager, so the same bits, and never more than one chunk's logits alive."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(45, 16, generator=g).to(dtype)
    weight = torch.randn(60, 16, generator=g).to(dtype)
    targets = torch.randint(0, 60, (45,), generator=g)
    targets[3::4] = -100

    def loss_fn(h, w):
        return 2.0 * lm_loss(h, w, targets, 8)

    def step(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        return loss, h.grad, w.grad

    ops = []

    def record(gm, example_inputs):            # the ATen graphs, forward and backward
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)

    torch._dynamo.reset()
    eager = step(loss_fn)
    for backend_name in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        compiled = step(torch.compile(loss_fn, fullgraph=True, backend=backend_name))
        for a, b in zip(compiled, eager):
            assert torch.equal(a, b), backend_name
    torch._dynamo.reset()
    step(torch.compile(loss_fn, fullgraph=True, backend=backend))
    assert sum("lm_loss_with_grads" in o for o in ops) == 1
    assert not any("logsumexp" in o for o in ops)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_op_agrees_with_its_fake_and_compiles_with_a_permuted_weight(transposed):
    """`lm_loss_with_grads`'s fake (what the compiler plans with) against its real outputs:
    shapes, dtypes and strides (`torch.library.opcheck`), also for a weight that is a
    transposed view, which compiled must still give eager's bits."""
    from pagedstash_func.interop._lm_loss import lm_loss_with_grads
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(21, 12, generator=g)
    base = torch.randn(12, 30, generator=g) if transposed else torch.randn(30, 12, generator=g)
    weight = base.T if transposed else base
    targets = torch.randint(0, 30, (21,), generator=g)
    torch.library.opcheck(lm_loss_with_grads, (hidden, weight, targets, 4))
    torch._dynamo.reset()

    def loss_fn(h, w):
        return lm_loss(h, w, targets, 4)
    outs = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        h, w = hidden.clone().requires_grad_(), weight.detach().clone().requires_grad_()
        if transposed:
            w = base.detach().clone().requires_grad_()
        loss = fn(h, w.T if transposed else w)
        loss.backward()
        outs.append((loss, h.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_through_the_kernel_it_equals_its_twin(dtype, monkeypatch):
    """The loss and gradients with each chunk's rows computed by the Triton kernel
    (``backend="triton"``, as ``"auto"`` picks on CUDA; on a CPU under the interpreter) against
    the torch twin's; a backend that is none of the three is refused by name."""
    from conftest import TRITON_BACKENDS

    if "triton" not in TRITON_BACKENDS:
        pytest.skip("the kernel needs CUDA or the Triton interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 16, generator=g).to(device, dtype)
    weight = torch.randn(1100, 16, generator=g).to(device, dtype)
    targets = torch.randint(0, 1100, (40,), generator=g).to(device)
    targets[::3] = -100

    def run(backend):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = lm_loss(h, w, targets, 16, backend=backend)
        loss.backward()
        return loss, h.grad, w.grad
    import pagedstash_func.kernels.cross_entropy as module
    launches = []
    launch = module.cross_entropy_rows_triton
    monkeypatch.setattr(module, "cross_entropy_rows_triton",
                        lambda *a: launches.append(1) or launch(*a))
    twin = run("torch")
    assert not launches
    kernel = run("triton")
    assert len(launches) == 3                        # a launch a chunk: 40 rows in 16s
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(kernel, twin):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="backend must be one of"):
        lm_loss(hidden, weight, targets, 16, backend="cuda")


def test_inputs_it_would_misread_are_refused_by_name():
    """A targets length other than the rows' (the mean would divide by the wrong count), a
    batch not flattened (the gather would index the sequence), bool targets, mixed dtypes:
    each a ValueError that names the fix, with gradients or without."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(8, 4, generator=g), torch.randn(5, 4, generator=g)
    t = torch.randint(0, 5, (8,), generator=g)
    cases = [((h, w, t[:7]), "targets must be \\[N\\] = \\[8\\]"),
             ((h, w, torch.cat([t, t[:1]])), "targets must be \\[N\\]"),
             ((h.view(2, 4, 4), w, t.view(2, 4)), "flatten a batch first"),
             ((h, w[:, :3], t), "hidden \\[N, H\\] and weight \\[V, H\\]"),
             ((h, w, t > 2), "int64 or int32 token ids"),
             ((h, w, t.float()), "int64 or int32 token ids"),
             ((h, w.double(), t), "share one floating dtype"),
             ((h.long(), w.long(), t), "share one floating dtype"),
             ((h, w, t.to("meta")), "on one device")]
    for args, text in cases:
        for grad in (False, True):
            a = [x.clone().requires_grad_(grad and x.is_floating_point()) if x.device.type
                 != "meta" else x for x in args]
            with pytest.raises(ValueError, match=text):
                lm_loss(*a, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        with torch.no_grad():
            lm_loss(h, w, t, 4, backend="cuda")      # refused without gradients too
