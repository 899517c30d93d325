"""psf.rms_norm and its kernels against transformers' RMSNorm formula and module."""

import pytest
import torch
from conftest import CPU_BACKENDS

import pagedstash_func as psf
from pagedstash_func import kernels


def _formula(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (37, 48)), (torch.float64, (5, 3, 20)),
                                         (torch.bfloat16, (19, 64)), (torch.float32, (0, 16))])
def test_forward_and_backward_equal_the_formula_under_autograd(backend, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(*shape, generator=g).to(dtype)
    ref = _formula(x, w, 1e-6)
    ref_dx, ref_dw = torch.autograd.grad(ref, [x, w], dy) if ref.numel() else (x * 0, w * 0)
    y = psf.rms_norm(x, w, 1e-6, backend=backend)
    dx, dw = torch.autograd.grad(y, [x, w], dy) if y.numel() else (x * 0, w * 0)
    # transformers' formula runs in fp32 whatever x's dtype (x.float()), fp64 included
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, ref, **tol)
    for got, want in ((dx, ref_dx), (dw, ref_dw)):     # relative to the largest entry: in
        assert got.shape == want.shape                     # bf16 transformers' dw rounds
        if want.numel():                                   # each product first
            err = (got.double() - want.double()).abs().max()
            assert err <= tol["rtol"] * want.double().abs().max() + 1e-12


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="CPU tensors; Triton there needs "
                    "the interpreter (the GPU tests run the kernels on CUDA)")
def test_the_triton_kernels_equal_their_twins():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 40, generator=g)
    w = torch.randn(40, generator=g)
    dy = torch.randn(70, 40, generator=g)
    y_t, r_t = kernels.rms_norm_forward(x, w, 1e-5, "triton")
    y_r, r_r = kernels.rms_norm_forward(x, w, 1e-5, "torch")
    torch.testing.assert_close(y_t, y_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r_t, r_r, rtol=1e-6, atol=0)
    for a, b in zip(kernels.rms_norm_backward(dy, x, w, r_r, "triton"),
                    kernels.rms_norm_backward(dy, x, w, r_r, "torch")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    again = kernels.rms_norm_backward(dy, x, w, r_r, "triton")      # a fixed order: same bits
    assert all(torch.equal(a, b) for a, b in zip(
        again, kernels.rms_norm_backward(dy, x, w, r_r, "triton")))


def test_it_composes_with_torch_func_and_equals_transformers_module():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    norm = Qwen3MoeRMSNorm(24, eps=1e-6).double()
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    torch.testing.assert_close(psf.rms_norm(x, norm.weight, 1e-6), norm(x))
    g = torch.func.grad(lambda w, x: psf.rms_norm(x, w).square().sum())(norm.weight.detach(), x)
    ref = torch.func.grad(lambda w, x: _formula(x, w, 1e-6).square().sum())(
        norm.weight.detach(), x)
    torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)     # both in fp32 inside


def test_bad_shapes_name_the_fix():
    with pytest.raises(ValueError, match="weight \\[H\\]"):
        psf.rms_norm(torch.zeros(3, 4), torch.ones(5))
    with pytest.raises(TypeError):
        psf.rms_norm([1.0], torch.ones(1))
    with pytest.raises(NotImplementedError, match="does not support vmap"):
        torch.func.vmap(lambda r: psf.rms_norm(r, torch.ones(4)))(torch.ones(3, 2, 4))
    with pytest.raises(NotImplementedError, match="does not support vmap"):  # closed over:
        torch.func.vmap(lambda s: psf.rms_norm(torch.ones(2, 4), torch.ones(4)) * s)(
            torch.arange(3.0))                          # torch would vmap the Function still
