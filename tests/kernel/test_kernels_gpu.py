"""On CUDA only: the stash kernels never sync, capture in a graph, spill to pinned memory."""

import sys

import pytest
import torch
from sync_free import without_sync

import pagedstash_func as psf

pytestmark = pytest.mark.gpu


def _state(host_factor=0.0, cuda_factor=1.0, capacity=500, width=384):
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=64,
                          cuda_factor=cuda_factor, host_factor=host_factor, backend="triton")
    specs = [psf.StashSpec(n, width, torch.bfloat16, capacity, capacity) for n in ("a", "b")]
    return psf.init_stash_state(specs, cfg, device="cuda")


def test_stash_and_pop_do_not_sync():
    state = _state(host_factor=1.0, cuda_factor=0.3)
    src = torch.randn(500, 384, device="cuda").bfloat16()
    n = torch.tensor([431], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state = psf.stash(state, "a", src, n)
        state = psf.stash(state, "b", src, n)
        out_b, state = psf.pop(state, "b")
        out_a, state = psf.pop(state, "a")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert psf.read_flags(state)["host_spill"]
    assert torch.equal(out_a[:431], src[:431]) and not out_a[431:].any()
    assert torch.equal(out_b, out_a)


def test_host_pool_is_pinned_and_used_by_the_kernel():
    state = _state(host_factor=2.0, cuda_factor=0.0)    # CUDA pool: 2 slack pages only
    pool = state.pools[state.layouts[0].key]
    assert pool.host.is_pinned() and pool.host.device.type == "cpu"
    src = torch.randn(500, 384, device="cuda").bfloat16()
    state = psf.stash(state, "a", src, torch.tensor([400], device="cuda"))
    view = psf.table_view(state, "a")
    assert len(view["cuda_pages"]) == 2 and len(view["host_pages"]) == 5
    assert torch.equal(pool.host[:64].cuda(), src[128:192])
    out, state = psf.pop(state, "a")
    assert torch.equal(out[:400], src[:400]) and not out[400:].any()


def test_stash_pop_capture_and_replay_in_a_cuda_graph():
    state = _state()
    table_a = (*psf.stash_slot(state, "a"), state.flags)
    src = torch.zeros(500, 384, device="cuda", dtype=torch.bfloat16)
    n = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):       # warm up (compile) outside the capture
        psf.kernels.stash_copy(src, n, *table_a, 64, "triton", 0, 0)
        psf.kernels.stash_pop(*table_a[:5], 500, 64, "triton", 0, 0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        psf.kernels.stash_copy(src, n, *table_a, 64, "triton", 0, 0)
        out = psf.kernels.stash_pop(*table_a[:5], 500, 64, "triton", 0, 0)
    for rows in (0, 63, 64, 500, 257):
        src.copy_(torch.randn(500, 384, device="cuda").bfloat16())
        n.fill_(rows)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:rows], src[:rows]) and not out[rows:].any()
    assert psf.pages_in_use(state)["bfloat16x384"]["cuda_used"] == 0


@pytest.mark.parametrize("host_factor", [0.0, 1.0])
def test_fused_stash_ops_do_not_sync_and_replay_in_a_cuda_graph(host_factor):
    """The layer's stash ops (reserve, the SwiGLU kernels that write and read pages, release)
    and gather_rows: no sync eagerly; captured once, replayed for several n, each replay gives
    the unfused kernels' bits and leaves no page held."""
    C, F, P, K = 500, 192, 64, psf.kernels
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=P,
                          cuda_factor=0.3 if host_factor else 1.0, host_factor=host_factor,
                          backend="triton")
    state = psf.init_stash_state([psf.StashSpec("act", 2 * F, torch.bfloat16, C, C)], cfg,
                                 device="cuda")
    slot, flags = psf.stash_slot(state, "act"), state.flags
    gate_up = torch.empty(C, 2 * F, device="cuda", dtype=torch.bfloat16)
    dz = torch.empty(C, F, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(C, device="cuda")
    x = torch.empty(300, F, device="cuda", dtype=torch.bfloat16)
    index = torch.empty(C, dtype=torch.int64, device="cuda")
    n = torch.zeros(1, dtype=torch.int32, device="cuda")

    def fill(rows):
        gate_up.copy_(torch.randn(C, 2 * F, device="cuda"))
        dz.copy_(torch.randn(C, F, device="cuda"))
        w.copy_(torch.rand(C, device="cuda"))
        x.copy_(torch.randn(300, F, device="cuda"))
        index.copy_(torch.randint(0, 300, (C,), device="cuda"))
        n.fill_(rows)

    def fused():
        K.stash_reserve(n, *slot, flags, C, P, "triton")
        z = K.swiglu_forward_stash(gate_up, w, n, slot.table, slot.cuda, slot.host, P, "triton")
        grads = K.swiglu_backward_paged(slot.table, slot.cuda, slot.host, dz, w, n, P, "triton")
        K.stash_release(*slot, P, "triton")
        return z, *grads, K.gather_rows(x, index, n, "triton")

    def unfused():
        return (K.swiglu_forward(gate_up, w, n, "triton"),
                *K.swiglu_backward(gate_up, dz, w, n, "triton"),
                K.gather_rows(x, index, n, "triton"))

    cuda_rows = psf.pages_in_use(state)["bfloat16x384"]["cuda_pages"] * P
    fill(431)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):      # warm up (compile) outside the capture
        fused(), unfused()
    torch.cuda.current_stream().wait_stream(stream)
    without_sync(fused)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fused()
    flags.zero_()             # the warm-up runs spilled; each replay is read on its own
    for rows in (0, 63, 64, C, 257):
        fill(rows)
        graph.replay()
        expected = unfused()
        torch.cuda.synchronize()
        for got, want in zip(outputs, expected):
            assert torch.equal(got[:rows], want[:rows])
        assert torch.equal(outputs[3], expected[3])          # d_w: zero past n in both
        assert psf.read_flags(state)["host_spill"] == (rows > cuda_rows)
        used = psf.pages_in_use(state)["bfloat16x384"]
        assert used["cuda_used"] == 0 and used["host_used"] == 0
        flags.zero_()


def _chain(backend, seed=5, steps=90):
    """Stashes, pops and releases of three tensors in one seeded random order, launched back
    to back without a sync; returns the popped outputs and the state (pools zeroed first, so
    the whole state compares bit for bit)."""
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=64, cuda_factor=0.3,
                          host_factor=0.3, backend=backend)   # 11 + 11 pages of 64 rows
    specs = [psf.StashSpec(n, 384, torch.bfloat16, 500, 500) for n in "abc"]
    state = psf.init_stash_state(specs, cfg, device="cuda")
    for pool in state.pools.values():
        pool.cuda.zero_()
        pool.host.zero_()
    gen = torch.Generator().manual_seed(seed)
    src = {n: torch.randn(500, 384, generator=gen).bfloat16().cuda() for n in "abc"}
    held, outs = set(), []
    for _ in range(steps):
        name = "abc"[int(torch.randint(3, (), generator=gen))]
        if name not in held:
            rows = int(torch.randint(0, 501, (), generator=gen))
            state = psf.stash(state, name, src[name], torch.tensor([rows], device="cuda"))
            held.add(name)
        elif torch.rand((), generator=gen) < 0.7:
            out, state = psf.pop(state, name)
            outs.append(out)
            held.discard(name)
        else:
            psf.kernels.stash_release(*psf.stash_slot(state, name), 64, backend)
            held.discard(name)
    for name in sorted(held):
        out, state = psf.pop(state, name)
        outs.append(out)
    for name in "abc":      # 3 x 8 pages do not fit in 22: the last one overflows
        state = psf.stash(state, name, src[name], torch.tensor([500], device="cuda"))
    for name in "abc":
        out, state = psf.pop(state, name)
        outs.append(out)
    return outs, state


needs_pdl = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None
    or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0")


class _Launches:
    """Stands in for a Triton kernel and keeps what each launch returns (the compiled kernel:
    its PTX and its launch metadata)."""

    def __init__(self, kernel):
        self.kernel, self.compiled = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled.append(self.kernel[grid](*args, **kwargs))
            return self.compiled[-1]
        return launch


@needs_pdl
@pytest.mark.parametrize("off", [False, True])
def test_second_launches_are_programmatic_dependents(monkeypatch, off):
    """The reserve and the pop's reader let the next launch start (`launch_dependents`); the
    page writer and the release are launched as programmatic dependents and wait
    (`griddepcontrol.wait`) before they read what the first launch writes; with
    ``PAGEDSTASH_NO_PDL=1`` none of it is compiled in or asked for."""
    monkeypatch.setenv(psf.kernels.PDL_OFF_ENV, "1" if off else "0")
    spies = {}
    for module, name in (("_pagestack", "_reserve_pages_kernel"),
                         ("stash_copy", "_write_pages_kernel"),
                         ("stash_pop", "_read_pages_kernel"),
                         ("_pagestack", "_release_pages_kernel")):
        module = sys.modules[f"pagedstash_func.kernels.{module}"]
        spies[name] = _Launches(getattr(module, name))
        monkeypatch.setattr(module, name, spies[name])
    state = _state()
    src = torch.randn(500, 384, device="cuda").bfloat16()
    state = psf.stash(state, "a", src, torch.tensor([300], device="cuda"))
    out, state = psf.pop(state, "a")
    assert torch.equal(out[:300], src[:300]) and not out[300:].any()
    for name, marks in (("_reserve_pages_kernel", ["launch_dependents"]),
                        ("_write_pages_kernel", ["wait"]),
                        ("_read_pages_kernel", ["launch_dependents"]),
                        ("_release_pages_kernel", ["wait"])):
        (compiled,) = spies[name].compiled
        ptx = compiled.asm["ptx"]
        for mark in marks:
            assert (f"griddepcontrol.{mark}" in ptx) != off, (name, mark)
        dependent = name in ("_write_pages_kernel", "_release_pages_kernel")
        assert getattr(compiled.metadata, "launch_pdl", None) == (dependent and not off), name


@needs_pdl
def test_programmatic_dependent_launch_changes_no_bit(monkeypatch):
    """Where PDL is on (compute capability 9.0 and later), the stash's page writer and the
    pop's release start while the launch before them runs; a long chain of stashes (spilling to
    the host and overflowing), pops and releases with no sync between them gives the same bits
    with PDL, without it and from the torch twin. (A race can hide in one run; that the second
    launches do run as dependents is `test_second_launches_are_programmatic_dependents`.)"""
    cuda = torch.device("cuda")
    monkeypatch.delenv(psf.kernels.PDL_OFF_ENV, raising=False)
    assert psf.kernels.use_pdl(cuda)
    runs = [_chain("triton")]
    monkeypatch.setenv("PAGEDSTASH_NO_PDL", "1")
    assert not psf.kernels.use_pdl(cuda)
    runs += [_chain("triton"), _chain("torch")]
    flags = psf.read_flags(runs[0][1])
    assert flags["host_spill"] and flags["overflow"]     # the chain reached both
    for outs, state in runs[1:]:
        assert len(outs) == len(runs[0][0]) > 20
        assert all(torch.equal(x, y) for x, y in zip(outs, runs[0][0]))
        for x, y in zip(torch.utils._pytree.tree_leaves(state),
                        torch.utils._pytree.tree_leaves(runs[0][1])):
            assert torch.equal(x, y)


@needs_pdl
@pytest.mark.parametrize("off", [False, True])
def test_the_launch_floor_pairs_its_launches_as_the_stash_and_pop_do(monkeypatch, off):
    """`bench stash --floor` stands for the stash and the pop only if its second launch is a
    programmatic dependent as theirs are: the copy after a word waits before it stores, the word
    after a copy waits before it stores, and each first launch lets its dependent start."""
    monkeypatch.setenv(psf.kernels.PDL_OFF_ENV, "1" if off else "0")
    floor = sys.modules["pagedstash_func.kernels.launch_floor"]
    src = torch.randn(300, 384, device="cuda").bfloat16()
    for shape, first, second in (("word first", "_word_kernel", "_flat_copy_kernel"),
                                 ("word after", "_flat_copy_kernel", "_word_kernel")):
        spies = {name: _Launches(getattr(floor, name))
                 for name in ("_word_kernel", "_flat_copy_kernel")}
        for name, spy in spies.items():
            monkeypatch.setattr(floor, name, spy)
        out, word = torch.empty_like(src), torch.tensor([7, 0], dtype=torch.int32, device="cuda")
        floor.floor_copy_triton(src, out, word, shape, 1024, 4)
        assert torch.equal(out, src) and word.tolist() == [7, 7]
        (lead,), (dependent,) = spies[first].compiled, spies[second].compiled
        assert ("griddepcontrol.launch_dependents" in lead.asm["ptx"]) != off, shape
        assert ("griddepcontrol.wait" in dependent.asm["ptx"]) != off, shape
        assert getattr(dependent.metadata, "launch_pdl", None) == (not off), shape
        assert not getattr(lead.metadata, "launch_pdl", False), shape
        for name in spies:
            monkeypatch.setattr(floor, name, spies[name].kernel)
