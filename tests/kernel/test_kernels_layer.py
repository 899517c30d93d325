"""The layer kernels (fused SwiGLU, gather-sum): twins against independent references, Triton
against the twins, and the rows and entries that must never be read filled with NaN."""

import pytest
import torch
from conftest import TRITON_BACKENDS, as_bytes

import pagedstash_func as psf
from pagedstash_func.kernels.gather_sum import (
    gather_sum, gather_sum_reference, gather_sum_triton,
)
from pagedstash_func.kernels.swiglu import (
    swiglu_backward, swiglu_backward_reference, swiglu_backward_triton, swiglu_forward,
    swiglu_forward_reference, swiglu_forward_triton,
)

NAN = float("nan")
# (rtol, atol) for Triton against the twin, by activation dtype. bf16 / fp16 outputs may differ
# by one rounding (the interpreter truncates to bf16, sigmoid differs in the last fp32 bits).
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5),
       torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
# (C, F, n): C not a multiple of BLOCK_R, F not a multiple of BLOCK_F, n at 0, C, in between.
SHAPES = [(13, 37, 9), (13, 37, 0), (13, 37, 13), (8, 16, 5), (33, 40, 17), (5, 3, 1)]


def weight_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu_inputs(capacity, width, n, dtype, device, seed=0):
    """gate_up, dz, w, n_valid with every row >= n filled with NaN (it must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(capacity, 2 * width, generator=gen, dtype=torch.float64) * 3)
    dz = torch.randn(capacity, width, generator=gen, dtype=torch.float64)
    w = torch.rand(capacity, generator=gen, dtype=torch.float64) + 0.1
    gate_up[n:], dz[n:], w[n:] = NAN, NAN, NAN
    return (gate_up.to(dtype).to(device), dz.to(dtype).to(device),
            w.to(weight_dtype(dtype)).to(device),
            torch.tensor([n], dtype=torch.int32, device=device))


def autograd_swiglu(gate_up, dz, w, n):
    """z, d_gate_up, d_w on the valid rows, by torch.autograd in fp64."""
    width = gate_up.shape[1] // 2
    g = gate_up[:n, :width].double().requires_grad_()
    u = gate_up[:n, width:].double().requires_grad_()
    ww = w[:n].double().requires_grad_()
    z = torch.nn.functional.silu(g) * u * ww[:, None]
    z.backward(dz[:n].double())
    return z.detach(), torch.cat([g.grad, u.grad], 1), ww.grad


def run_swiglu(backend, gate_up, dz, w, n_valid, blocks=None):
    """(z from the forward, d_gate_up, z from the backward, d_w) on one backend."""
    if blocks is None:
        return (swiglu_forward(gate_up, w, n_valid, backend),
                *swiglu_backward(gate_up, dz, w, n_valid, backend))
    return (swiglu_forward_triton(gate_up, w, n_valid, *blocks),
            *swiglu_backward_triton(gate_up, dz, w, n_valid, *blocks))


@pytest.mark.parametrize("capacity,width,n", SHAPES)
def test_swiglu_twin_matches_autograd(device, capacity, width, n):
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, torch.float64, device)
    z_ref, dgu_ref, dw_ref = autograd_swiglu(gate_up, dz, w, n)
    z = swiglu_forward_reference(gate_up, w, n_valid)
    dgu, z_b, dw = swiglu_backward_reference(gate_up, dz, w, n_valid)
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z[:n], z_ref, **close)
    torch.testing.assert_close(dgu[:n], dgu_ref, **close)
    torch.testing.assert_close(dw[:n], dw_ref, **close)
    assert torch.equal(z[:n], z_b[:n])
    assert dw.dtype == torch.float64 and not dw[n:].any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("capacity,width,n", SHAPES)
def test_swiglu_triton_matches_twin(device, dtype, capacity, width, n):
    if "triton" not in TRITON_BACKENDS:
        pytest.skip("Triton needs CUDA or the interpreter")
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, dtype, device, seed=capacity)
    z_t, dgu_t, zb_t, dw_t = run_swiglu("torch", gate_up, dz, w, n_valid)
    rtol, atol = TOL[dtype]
    # The op's own launch, then small blocks: several F chunks, a partial last chunk and a
    # partial last row block.
    for blocks in (None, (4, 16, 2)):
        z, dgu, zb, dw = run_swiglu("triton", gate_up, dz, w, n_valid, blocks)
        assert z.dtype == dgu.dtype == zb.dtype == dtype and dw.dtype == w.dtype
        assert z.shape == (capacity, width) and dgu.shape == (capacity, 2 * width)
        torch.testing.assert_close(z[:n], z_t[:n], rtol=rtol, atol=atol)
        torch.testing.assert_close(dgu[:n], dgu_t[:n], rtol=rtol, atol=atol)
        torch.testing.assert_close(dw[:n], dw_t[:n], rtol=max(rtol, 1e-5), atol=max(atol, 1e-5))
        assert torch.equal(zb[:n], z[:n])                   # backward recomputes z exactly
        assert torch.equal(dw[n:], torch.zeros_like(dw[n:]))


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_never_reads_rows_past_n(device, backend, dtype):
    capacity, width, n = 21, 24, 11
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, dtype, device, seed=5)
    assert gate_up[n:].isnan().all() and dz[n:].isnan().all() and w[n:].isnan().all()
    z, dgu, zb, dw = run_swiglu(backend, gate_up, dz, w, n_valid)
    for out in (z, dgu, zb):
        assert out[:n].isfinite().all()
    assert dw[:n].isfinite().all() and torch.equal(dw[n:], torch.zeros_like(dw[n:]))
    assert torch.equal(zb[:n], z[:n])
    # Deterministic: a second run gives the same bits (no atomics, fixed d_w order).
    again = run_swiglu(backend, gate_up, dz, w, n_valid)
    for a, b in zip((z, dgu, zb, dw), again):
        assert torch.equal(a[:n], b[:n])


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_swiglu_n_past_capacity_and_int64_count(device, backend):
    # n larger than C is clamped to C; an int64 count works like an int32 one.
    gate_up, dz, w, _ = swiglu_inputs(6, 8, 6, torch.float32, device)
    n_valid = torch.tensor([100], dtype=torch.int64, device=device)
    z, dgu, zb, dw = run_swiglu(backend, gate_up, dz, w, n_valid)
    z_ref, dgu_ref, dw_ref = autograd_swiglu(gate_up, dz, w, 6)
    torch.testing.assert_close(z.double(), z_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dgu.double(), dgu_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-5, atol=1e-5)


def test_swiglu_bad_arguments_raise(device):
    gate_up, dz, w, n_valid = swiglu_inputs(4, 8, 2, torch.float32, device)
    with pytest.raises(ValueError, match=r"\[C, 2F\]"):
        swiglu_forward(gate_up[:, :15], w, n_valid)
    with pytest.raises(ValueError, match="one weight per row"):
        swiglu_forward(gate_up, w[:3], n_valid)
    with pytest.raises(ValueError, match="one-element integer"):
        swiglu_forward(gate_up, w, n_valid.float())
    with pytest.raises(ValueError, match=r"dz.to\(gate_up.dtype\)"):
        swiglu_backward(gate_up, dz.double(), w, n_valid)
    with pytest.raises(ValueError, match=r"\[C, F\]"):
        swiglu_backward(gate_up, dz[:, :4], w, n_valid)
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_forward(gate_up.t().contiguous().t(), w, n_valid)
    with pytest.raises(ValueError, match="w.float"):
        swiglu_forward(gate_up, w.long(), n_valid)


# ----------------------------------------------------------------------------- gather_sum


def padded_source(rows, width, dtype, device, seed=0):
    """src [rows, H] as a view into a buffer whose rows just before and after it are NaN and
    inf: an index that is -1..-4 or R..R+3, if it were read, would bring them in."""
    gen = torch.Generator().manual_seed(seed)
    big = (torch.randn(rows + 8, width, generator=gen, dtype=torch.float64) * 4).to(dtype)
    big[:4], big[rows + 4:] = NAN, float("inf")
    big = big.to(device)
    return big[4:4 + rows]


def random_index(tokens, top_k, rows, device, seed=0, skip=0.3):
    """[tokens * top_k] int64 with about ``skip`` of entries out of range (negative or >= R)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, max(rows, 1), (tokens * top_k,), generator=gen)
    bad = torch.rand(tokens * top_k, generator=gen) < skip
    if rows == 0:
        bad[:] = True
    far = torch.randint(0, 4, (tokens * top_k,), generator=gen)
    far = torch.where(torch.rand(tokens * top_k, generator=gen) < 0.5, -1 - far, rows + far)
    return torch.where(bad, far, idx).to(device)


def hand_gather_sum(src, index, top_k):
    """Token by token, slot by slot, in the wide dtype."""
    rows, width = src.shape
    wide = torch.promote_types(src.dtype, torch.float32)
    out = torch.empty(index.shape[0] // top_k, width, dtype=src.dtype)
    src, index = src.cpu(), index.cpu().tolist()
    for t in range(out.shape[0]):
        acc = torch.zeros(width, dtype=wide)
        for s in range(top_k):
            i = index[t * top_k + s]
            if 0 <= i < rows:
                acc = acc + src[i].to(wide)
        out[t] = acc.to(src.dtype)
    return out


GS_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", GS_DTYPES)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_gather_sum_twin_matches_hand_loop(device, dtype, top_k):
    src = padded_source(23, 70, dtype, device, seed=top_k)
    index = random_index(11, top_k, 23, device, seed=top_k)
    out = gather_sum_reference(src, index, top_k)
    assert out.dtype == dtype and out.shape == (11, 70) and out.isfinite().all()
    assert torch.equal(out.cpu(), hand_gather_sum(src, index, top_k))


@pytest.mark.parametrize("dtype", GS_DTYPES)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_gather_sum_triton_equals_twin(device, dtype, top_k):
    if "triton" not in TRITON_BACKENDS:
        pytest.skip("Triton needs CUDA or the interpreter")
    tokens, rows, width = 19, 30, 70            # H not a power of two, partial token blocks
    src = padded_source(rows, width, dtype, device, seed=7 * top_k)
    index = random_index(tokens, top_k, rows, device, seed=top_k)
    index[:top_k] = -1                          # token 0: every entry skipped
    index[top_k:2 * top_k] = rows               # token 1 too, past the end
    ref = gather_sum_reference(src, index, top_k)
    assert not ref[:2].any() and ref.isfinite().all()
    for out in (gather_sum(src, index, top_k, "triton"),
                gather_sum_triton(src, index, top_k, 2, 16, 1)):
        assert out.dtype == dtype and out.shape == ref.shape
        assert torch.equal(out, ref)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_gather_sum_edge_sizes(device, backend):
    src = padded_source(5, 33, torch.float32, device)
    empty = gather_sum(src, torch.empty(0, dtype=torch.int64, device=device), 6, backend)
    assert empty.shape == (0, 33)
    no_rows = src[:0]
    out = gather_sum(no_rows, torch.tensor([0, -1, 3, 5], device=device), 2, backend)
    assert out.shape == (2, 33) and not out.any()
    idx32 = torch.tensor([4, 0, -2, 1], dtype=torch.int32, device=device)
    torch.testing.assert_close(gather_sum(src, idx32, 2, backend),
                               torch.stack([src[4] + src[0], src[1]]), rtol=0, atol=0)


def test_gather_sum_bad_arguments_raise(device):
    src = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="multiple of top_k"):
        gather_sum(src, torch.zeros(5, dtype=torch.int64, device=device), 2)
    with pytest.raises(ValueError, match="long"):
        gather_sum(src, torch.zeros(4, device=device), 2)
    with pytest.raises(ValueError, match=r"\[R, H\]"):
        gather_sum(src[0], torch.zeros(4, dtype=torch.int64, device=device), 2)


# ----------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_layer_ops_pass_opcheck(device, backend):
    # n = C: opcheck compares outputs across its runs, and rows past n are left unwritten.
    gate_up, dz, w, n_valid = swiglu_inputs(6, 12, 6, torch.float32, device)
    torch.library.opcheck(swiglu_forward, (gate_up, w, n_valid, backend))
    torch.library.opcheck(swiglu_backward, (gate_up, dz, w, n_valid, backend))
    src = padded_source(9, 20, torch.float32, device)
    index = random_index(5, 3, 9, device)
    torch.library.opcheck(gather_sum, (src.clone(), index, 3, backend))
    # n < C: every check but the output comparison (the unwritten rows differ between runs).
    gate_up, dz, w, n_valid = swiglu_inputs(6, 12, 4, torch.float32, device)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(swiglu_forward, (gate_up, w, n_valid, backend), test_utils=utils)
    torch.library.opcheck(swiglu_backward, (gate_up, dz, w, n_valid, backend), test_utils=utils)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_layer_kernels_on_gpu_at_scale_without_syncs():
    capacity, width, n, hidden, top_k, tokens = 4096, 1408, 3001, 2048, 6, 4096
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, torch.bfloat16, "cuda")
    rows = tokens * top_k - 977
    src = padded_source(rows, hidden, torch.bfloat16, "cuda")
    index = random_index(tokens, top_k, rows, "cuda", skip=0.1)
    # Warm up (compile) before watching for syncs.
    swiglu_forward(gate_up, w, n_valid, "triton")
    swiglu_backward(gate_up, dz, w, n_valid, "triton")
    gather_sum(src, index, top_k, "triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        z = swiglu_forward(gate_up, w, n_valid, "auto")
        dgu, zb, dw = swiglu_backward(gate_up, dz, w, n_valid, "auto")
        out = gather_sum(src, index, top_k, "auto")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    z_t, dgu_t, zb_t, dw_t = run_swiglu("torch", gate_up, dz, w, n_valid)
    torch.testing.assert_close(z[:n], z_t[:n], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dgu[:n], dgu_t[:n], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw[:n], dw_t[:n], rtol=1e-4, atol=1e-4)
    assert torch.equal(zb[:n], z[:n]) and not dw[n:].any()
    assert torch.equal(out, gather_sum_reference(src, index, top_k))


# ----------------------------------------------------------------------------- fused with the stash

def page_state(capacity, width, dtype, device, backend, cuda_factor, host_factor, page=4):
    """A stash state for one ``[capacity, 2 * width]`` tensor "g", pools full of 0xFF garbage."""
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=page,
                          cuda_factor=cuda_factor, host_factor=host_factor, backend=backend)
    state = psf.init_stash_state([psf.StashSpec("g", 2 * width, dtype, capacity, capacity)], cfg,
                                 device=device)
    for pool in state.pools.values():
        pool.cuda.view(torch.uint8).fill_(255)
        pool.host.view(torch.uint8).fill_(255)
    return state, page


# (n, cuda_factor, host_factor) for 13 rows in pages of 4: all on the device (5 device pages);
# split device/host (3, 2 and 1 device pages, 5 host pages); an overflow (2 pages, no host)
STASH_CASES = [(9, 1.0, 0.0), (0, 1.0, 0.0), (13, 1.0, 0.0), (13, 0.4, 1.0), (12, 0.2, 1.0),
               (11, 0.0, 1.0), (11, 0.3, 0.0)]


def assert_flags_as_planned(state, n, page):
    """The flags the page counts imply: a spill exactly when the device pages run out, an
    overflow exactly when the host pages run out too."""
    pool = next(iter(state.pools.values()))
    cuda_pages, host_pages = pool.cuda.shape[0] // page, pool.host.shape[0] // page
    need = -(-n // page)
    flags = psf.read_flags(state)
    assert flags["overflow"] == (need > cuda_pages + host_pages)
    assert flags["host_spill"] == (cuda_pages < need <= cuda_pages + host_pages)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,cuda_factor,host_factor", STASH_CASES)
def test_fused_stash_equals_swiglu_then_stash_copy_bit_for_bit(device, backend, dtype, n,
                                                                cuda_factor, host_factor):
    capacity, width = 13, 10
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, dtype, device, seed=n)
    states = []
    for fused in (False, True):
        state, page = page_state(capacity, width, dtype, device, backend, cuda_factor,
                                 host_factor)
        slot = psf.stash_slot(state, "g")
        if fused:
            psf.kernels.stash_reserve(n_valid, slot.table, slot.cuda, slot.host,
                                      slot.free_pages, slot.cursors, state.flags, capacity,
                                      page, backend)
            z = psf.kernels.swiglu_forward_stash(gate_up, w, n_valid, slot.table, slot.cuda,
                                                 slot.host, page, backend)
        else:
            psf.kernels.stash_copy(gate_up, n_valid, *slot, state.flags, page, backend)
            z = swiglu_forward(gate_up, w, n_valid, backend)
        states.append((z[:n], state))
    (z_a, a), (z_b, b) = states
    assert torch.equal(z_a, z_b)
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        assert torch.equal(as_bytes(x), as_bytes(y))       # pools, tables, cursors, flags
    assert_flags_as_planned(b, n, page)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("n,cuda_factor,host_factor", STASH_CASES)
def test_paged_swiglu_backward_equals_pop_then_backward_bit_for_bit(device, backend, n,
                                                                    cuda_factor, host_factor):
    capacity, width, dtype = 13, 10, torch.bfloat16
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, dtype, device, seed=7 + n)
    results = []
    for paged in (False, True):
        state, page = page_state(capacity, width, dtype, device, backend, cuda_factor,
                                 host_factor)
        slot = psf.stash_slot(state, "g")
        psf.kernels.stash_copy(gate_up, n_valid, *slot, state.flags, page, backend)
        if paged:
            grads = psf.kernels.swiglu_backward_paged(slot.table, slot.cuda, slot.host, dz, w,
                                                      n_valid, page, backend)
            psf.kernels.stash_release(*slot, page, backend)
        else:
            popped = psf.kernels.stash_pop(*slot, capacity, page, backend, 0, 0, 0, False)
            grads = swiglu_backward(popped, dz, w, n_valid, backend)
        d_gu, z, d_w = grads
        results.append((d_gu[:n], z[:n], d_w, state))
    for x, y in zip(results[0][:3], results[1][:3]):
        assert torch.equal(as_bytes(x), as_bytes(y))
    for x, y in zip(torch.utils._pytree.tree_leaves(results[0][3]),
                    torch.utils._pytree.tree_leaves(results[1][3])):
        assert torch.equal(as_bytes(x), as_bytes(y))       # every page back, table emptied
    assert_flags_as_planned(results[1][3], n, 4)
    if n and cuda_factor + host_factor >= 1.0:            # held: the real rows, not zeros
        z_ref, _, _ = autograd_swiglu(gate_up, dz, w, n)
        torch.testing.assert_close(results[1][1].double(), z_ref, rtol=2e-2, atol=2e-2)


def test_fused_twin_and_triton_write_the_same_pages(device):
    if "triton" not in TRITON_BACKENDS:
        pytest.skip("Triton needs CUDA or the interpreter")
    capacity, width, n = 13, 10, 11
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, torch.bfloat16, device, seed=3)
    leaves = []
    for backend in ("torch", "triton"):
        state, page = page_state(capacity, width, torch.bfloat16, device, backend, 0.2, 1.0)
        slot = psf.stash_slot(state, "g")
        psf.kernels.stash_reserve(n_valid, slot.table, slot.cuda, slot.host, slot.free_pages,
                                  slot.cursors, state.flags, capacity, page, backend)
        psf.kernels.swiglu_forward_stash(gate_up, w, n_valid, slot.table, slot.cuda, slot.host,
                                         page, backend)
        leaves.append(torch.utils._pytree.tree_leaves(state))
    for x, y in zip(*leaves):
        assert torch.equal(as_bytes(x), as_bytes(y))


@pytest.mark.parametrize("n", [33, 50])
def test_fused_round_trip_over_many_programs_and_split_pages(device, n):
    """37 rows of F = 70 in pages of 5 (7 device pages, the rest on the host), 8-row blocks
    straddling pages, 16-column steps: reserve + fused forward, then paged backward + release,
    against stash copy + SwiGLU, then pop + SwiGLU backward, on each backend, bit for bit."""
    if "triton" not in TRITON_BACKENDS:
        pytest.skip("Triton needs CUDA or the interpreter")
    capacity, width, page, blocks = 37, 70, 5, (8, 16, 0)
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, min(n, capacity), torch.float32,
                                            device, seed=n)
    for backend in ("torch", "triton"):
        runs = []
        for fused in (False, True):
            state, _ = page_state(capacity, width, torch.float32, device, backend, 0.3, 1.0,
                                  page=page)
            slot = psf.stash_slot(state, "g")
            pages = (slot.table, slot.cuda, slot.host, page)
            if fused:
                psf.kernels.stash_reserve(n_valid, slot.table, slot.cuda, slot.host,
                                          slot.free_pages, slot.cursors, state.flags, capacity,
                                          page, backend)
                z = (swiglu_forward_triton(gate_up, w, n_valid, *blocks, pages=pages)
                     if backend == "triton" else psf.kernels.swiglu_forward_stash(
                         gate_up, w, n_valid, *pages, backend))
                held = [t.clone() for t in torch.utils._pytree.tree_leaves(state)]
                grads = (swiglu_backward_triton(None, dz, w, n_valid, *blocks, pages=pages)
                         if backend == "triton" else psf.kernels.swiglu_backward_paged(
                             *pages[:3], dz, w, n_valid, page, backend))
                psf.kernels.stash_release(*slot, page, backend)
            else:
                psf.kernels.stash_copy(gate_up, n_valid, *slot, state.flags, page, backend)
                z = (swiglu_forward_triton(gate_up, w, n_valid, *blocks)
                     if backend == "triton" else swiglu_forward(gate_up, w, n_valid, backend))
                held = [t.clone() for t in torch.utils._pytree.tree_leaves(state)]
                popped = psf.kernels.stash_pop(*slot, capacity, page, backend, 0, 0, 0, False)
                grads = (swiglu_backward_triton(popped, dz, w, n_valid, *blocks)
                         if backend == "triton" else swiglu_backward(popped, dz, w, n_valid,
                                                                     backend))
            rows = min(n, capacity)
            runs.append([z[:rows], grads[0][:rows], grads[1][:rows], grads[2], *held,
                         *torch.utils._pytree.tree_leaves(state)])
        assert psf.read_flags(state)["host_spill"]
        for a, b in zip(*runs):
            assert torch.equal(as_bytes(a), as_bytes(b))


def test_fused_ops_refuse_pools_that_do_not_fit(device):
    gate_up, dz, w, n_valid = swiglu_inputs(8, 4, 5, torch.float32, device)
    state, page = page_state(8, 4, torch.float32, device, "torch", 1.0, 0.0)
    slot = psf.stash_slot(state, "g")
    with pytest.raises(ValueError, match="rows of 6"):
        psf.kernels.swiglu_forward_stash(gate_up[:, :6].contiguous(), w, n_valid, slot.table,
                                         slot.cuda, slot.host, page)
    with pytest.raises(ValueError, match="rows of 8 torch.bfloat16"):
        psf.kernels.swiglu_backward_paged(slot.table, slot.cuda, slot.host,
                                          dz.to(torch.bfloat16), w, n_valid, page)
    with pytest.raises(ValueError, match="page table for 16 rows"):
        psf.kernels.swiglu_forward_stash(torch.cat([gate_up, gate_up]), torch.cat([w, w]),
                                         n_valid, slot.table, slot.cuda, slot.host, page)


# ----------------------------------------------------------------------------- gather_rows

@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 9, 17, 40])
def test_gather_rows_fills_the_valid_rows_and_reads_nothing_past_n(device, backend, n):
    tokens, width, capacity = 11, 24, 17
    gen = torch.Generator().manual_seed(n)
    wide = torch.randn(tokens, 2 * width, generator=gen).to(device)
    src = wide[:, :width]                                # strided rows, unit-stride columns
    index = torch.randint(0, tokens, (capacity,), generator=gen).to(device)
    index[min(n, capacity):] = 10 ** 9                   # past n: never dereferenced
    n_valid = torch.tensor([n], dtype=torch.int32, device=device)
    out = psf.kernels.gather_rows(src, index, n_valid, backend)
    kept = min(n, capacity)
    assert out.shape == (capacity, width)
    assert torch.equal(out[:kept], src[index[:kept]])


def test_gather_rows_twin_and_triton_agree_bit_for_bit(device):
    if "triton" not in TRITON_BACKENDS:
        pytest.skip("Triton needs CUDA or the interpreter")
    src = torch.randn(30, 200, dtype=torch.float64).to(torch.bfloat16).to(device)
    index = torch.randint(0, 30, (50,), dtype=torch.int32).to(device)
    n_valid = torch.tensor([37], device=device)
    outs = [psf.kernels.gather_rows(src, index, n_valid, b) for b in ("torch", "triton")]
    assert torch.equal(as_bytes(outs[0][:37]), as_bytes(outs[1][:37]))


def test_gather_rows_bad_arguments_raise(device):
    src = torch.zeros(4, 8, device=device)
    n = torch.tensor([2], device=device)
    with pytest.raises(ValueError, match=r"\[C\] int32 or int64"):
        psf.kernels.gather_rows(src, torch.zeros(3, device=device), n)
    with pytest.raises(ValueError, match="one-element integer"):
        psf.kernels.gather_rows(src, torch.zeros(3, dtype=torch.long, device=device),
                                torch.tensor([2.0], device=device))
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        psf.kernels.gather_rows(src[0], torch.zeros(3, dtype=torch.long, device=device), n)


def test_fused_ops_pass_opcheck(device):
    capacity, width = 8, 4
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, capacity, torch.float32, device)
    state, page = page_state(capacity, width, torch.float32, device, "torch", 1.0, 0.0)
    slot = psf.stash_slot(state, "g")
    for backend in TRITON_BACKENDS:
        torch.library.opcheck(psf.kernels.stash_reserve,
                              (n_valid, slot.table, slot.cuda, slot.host, slot.free_pages,
                               slot.cursors, state.flags, capacity, page, backend))
        torch.library.opcheck(psf.kernels.swiglu_forward_stash,
                              (gate_up, w, n_valid, slot.table, slot.cuda, slot.host, page,
                               backend))
        torch.library.opcheck(psf.kernels.swiglu_backward_paged,
                              (slot.table, slot.cuda, slot.host, dz, w, n_valid, page, backend))
        torch.library.opcheck(psf.kernels.gather_rows,
                              (gate_up, torch.arange(capacity, device=device), n_valid, backend))


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_page_ids_outside_the_pools_are_never_touched(device, backend):
    """A table reserved with pages of 4 read as pages of 20 (the same pool divides by both):
    the ids then point past the pools; both backends skip them alike, nothing out of bounds."""
    capacity, width, n = 13, 10, 13
    gate_up, dz, w, n_valid = swiglu_inputs(capacity, width, n, torch.float32, device, seed=2)
    state, page = page_state(capacity, width, torch.float32, device, backend, 1.5, 0.0)
    slot = psf.stash_slot(state, "g")
    slot.free_pages.copy_(slot.free_pages.flip(0))        # the first id taken is the last page
    psf.kernels.stash_reserve(n_valid, slot.table, slot.cuda, slot.host, slot.free_pages,
                              slot.cursors, state.flags, capacity, page, backend)
    big = slot.cuda.shape[0]
    assert big % 4 == 0 and slot.table[4] > 0           # page 0 of the table is not page 0
    before = slot.cuda.clone()
    psf.kernels.swiglu_forward_stash(gate_up, w, n_valid, slot.table, slot.cuda, slot.host,
                                     big, backend)
    assert torch.equal(as_bytes(before), as_bytes(slot.cuda))    # id past the one big page
    d_gu, z, _ = psf.kernels.swiglu_backward_paged(slot.table, slot.cuda, slot.host, dz, w,
                                                   n_valid, big, backend)
    assert not z[:n].any()                                       # read as zeros


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_gather_rows_gives_zeros_for_indices_off_the_source(device, backend):
    src = torch.arange(1.0, 13.0, device=device).reshape(4, 3)
    index = torch.tensor([1, 4, -1, 3, 10 ** 6], device=device)
    out = psf.kernels.gather_rows(src, index, torch.tensor([5], device=device), backend)
    expect = torch.stack([src[1], src[0] * 0, src[0] * 0, src[3], src[0] * 0])
    assert torch.equal(out, expect)
