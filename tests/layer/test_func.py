"""The stash ops inside a new-style autograd.Function, under torch.func.grad, vjp and autograd.

This is the pattern the MoE layer uses (DESIGN §5): the custom ops never see a tensor that is
being differentiated, the pool arrives as an explicit input, and setup_context keeps only the
row count and the pool (as plain attributes: the pool is mutated by later stashes, so it must
not go through save_for_backward's version check).
"""

import pytest
import torch

import pagedstash_func as psf


class SquareSumStashed(torch.autograd.Function):
    """``sum(x[:n] ** 2)`` that stashes ``x``'s valid rows for backward instead of saving ``x``."""

    @staticmethod
    def forward(x, n, table, cuda, host, free, cursors, flags, page_size, backend):
        psf.kernels.stash_copy(x.contiguous(), n, table, cuda, host, free, cursors, flags,
                               page_size, backend, 0, 0)
        valid = (torch.arange(x.shape[0], device=x.device) < n).unsqueeze(1)
        return torch.where(valid, x * x, 0).sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, n, table, cuda, host, free, cursors, flags, page_size, backend = inputs
        ctx.pool = (table, cuda, host, free, cursors)
        ctx.meta = (x.shape[0], page_size, backend)

    @staticmethod
    def backward(ctx, grad_out):
        capacity, page_size, backend = ctx.meta
        x_valid = psf.kernels.stash_pop(*ctx.pool, capacity, page_size, backend, 0, 0)
        return (2 * x_valid * grad_out,) + (None,) * 9


def loss(x, n, state_tensors, page_size, backend):
    return SquareSumStashed.apply(x, n, *state_tensors, page_size, backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["func.grad", "func.vjp", "autograd"])
def test_stash_inside_autograd_function(device, backend, mode):
    capacity, width, n_rows = 40, 12, 27
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=8, backend=backend)
    state = psf.init_stash_state([psf.StashSpec("x", width, torch.float32, capacity, capacity)],
                                 cfg, device=device)
    tensors = (*psf.stash_slot(state, "x"), state.flags)
    x = torch.randn(capacity, width, dtype=torch.float32, device=device)
    n = torch.tensor([n_rows], device=device)
    if mode == "func.grad":
        g = torch.func.grad(loss)(x, n, tensors, 8, backend)
    elif mode == "func.vjp":
        _, fn = torch.func.vjp(lambda x_: loss(x_, n, tensors, 8, backend), x)
        (g,) = fn(torch.tensor(1.0, device=device))
    else:
        x_req = x.clone().requires_grad_()
        loss(x_req, n, tensors, 8, backend).backward()
        g = x_req.grad
    expected = torch.zeros_like(x)
    expected[:n_rows] = 2 * x[:n_rows]
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    # Forward stashed, backward popped: every page is free again.
    assert psf.pages_in_use(state)["float32x12"]["cuda_used"] == 0
