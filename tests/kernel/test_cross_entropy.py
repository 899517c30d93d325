"""The cross-entropy rows kernel against its torch twin, and the twin against torch's own
cross-entropy on the full logits."""

import pytest
import torch
from conftest import TRITON_BACKENDS

from pagedstash_func.kernels.cross_entropy import (
    cross_entropy_rows,
    cross_entropy_rows_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, width, generator=g) * 4).to(dtype).to(DEVICE)
    targets = torch.randint(0, width, (rows,), generator=g)
    targets[1::3] = -100
    return logits, targets.to(DEVICE), torch.tensor(1 / 7, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(5, 37), (3, 1024), (4, 2500), (0, 16)])
def test_the_kernel_equals_its_twin(rows, width, dtype):
    """Widths under, at and over a block (the CPU's is 1024), rows without a target."""
    if "triton" not in TRITON_BACKENDS:
        pytest.skip("the kernel needs CUDA or the Triton interpreter")
    logits, targets, scale = _inputs(rows, width, dtype)
    before = logits.clone()
    loss, grad = cross_entropy_rows(logits, targets, scale, backend="triton")
    ref_loss, ref_grad = cross_entropy_rows_reference(logits, targets, scale)
    assert torch.equal(logits, before)                      # the input is not written
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]   # a bf16 rounding apart at most
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=tol, atol=1e-7)
    assert not grad[1::3].any() and not loss[1::3].any()     # no target: nothing
    again = cross_entropy_rows(logits, targets, scale, backend="triton")
    assert torch.equal(again[0], loss) and torch.equal(again[1], grad)   # no atomics


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_twin_is_torchs_cross_entropy(dtype):
    logits, targets, _ = _inputs(6, 50, dtype, seed=3)
    logits = logits.requires_grad_()
    ours, grad = cross_entropy_rows_reference(logits.detach(), targets,
                                              torch.tensor(1.0, dtype=dtype, device=DEVICE))
    theirs = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100,
                                               reduction="sum")
    theirs.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ours.sum(), theirs.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grad, logits.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_edges_a_target_naming_no_token_and_infinite_logits(backend):
    """A target outside [0, V) other than -100 gives its row NaN (no read out of bounds; the
    other rows as they were); a block of -inf logits is summed as nothing; targets may be a
    strided view."""
    logits = torch.randn(5, 2500, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits[1, :1024] = float("-inf")
    big = torch.tensor([3, 0, 2500, 0, -1, 0, 10**9, 0, 7, 0], device=DEVICE)
    targets, scale = big[::2], torch.tensor(0.5, device=DEVICE)
    loss, grad = cross_entropy_rows(logits, targets, scale, backend=backend)
    assert loss[[1, 2, 3]].isnan().all() and grad[[1, 2, 3]].isnan().all()
    ref_loss, ref_grad = cross_entropy_rows_reference(logits[[0, 4]], targets[[0, 4]], scale)
    torch.testing.assert_close(loss[[0, 4]], ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad[[0, 4]], ref_grad, rtol=1e-6, atol=1e-7)
    finite = torch.tensor([1500], device=DEVICE)
    row = cross_entropy_rows(logits[1:2].contiguous(), finite, scale, backend=backend)[0]
    torch.testing.assert_close(row, torch.logsumexp(logits[1], 0)[None] - logits[1, 1500],
                               rtol=1e-6, atol=1e-6)


def test_its_fake_matches_and_bad_input_is_named():
    logits, targets, scale = _inputs(4, 40, torch.float32)
    torch.library.opcheck(cross_entropy_rows, (logits, targets, scale, "torch"))
    with pytest.raises(ValueError, match="logits \\[c, V\\]"):
        cross_entropy_rows(logits[0], targets, scale)
    with pytest.raises(ValueError, match="contiguous"):
        cross_entropy_rows(logits.T.contiguous().T, targets, scale)
    with pytest.raises(ValueError, match="integer token ids"):
        cross_entropy_rows(logits, targets.float(), scale)
    with pytest.raises(ValueError, match="V > 0"):
        cross_entropy_rows(logits[:, :0], targets, scale)
    for dtype in (torch.int32, torch.bool, torch.complex64):    # no floating logits
        with pytest.raises(ValueError, match="logits must be bf16, fp16, fp32 or fp64"):
            cross_entropy_rows(logits.to(dtype), targets, scale)
