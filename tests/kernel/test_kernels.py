"""Every Triton stash kernel against its torch twin, bit for bit, and both against the source."""

import math
import sys

import pytest
import torch
import torch.utils._pytree as pytree

triton = pytest.importorskip("triton", reason="the Triton kernels need Triton (Linux only)")
import triton.language as tl  # noqa: E402
from conftest import TRITON_BACKENDS, as_bytes  # noqa: E402

import pagedstash_func as psf  # noqa: E402
from pagedstash_func.kernels import layout  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


def random_rows(rows, width, dtype, gen, device):
    if dtype == torch.uint8:
        x = torch.randint(0, 256, (rows, width), generator=gen, dtype=torch.uint8)
    else:
        x = (torch.randn(rows, width, generator=gen) * 10).to(dtype)
    return x.to(device)


def make_state(specs, device, backend, page_size=16, cuda_factor=1.1, host_factor=0.0):
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=page_size,
                          cuda_factor=cuda_factor, host_factor=host_factor, backend=backend)
    return psf.init_stash_state(specs, cfg, device=device)


def twin_pair(specs, device, **kw):
    """Two states with bit-identical buffers (garbage included), one per backend."""
    a = make_state(specs, device, "torch", **kw)
    leaves, spec = pytree.tree_flatten(a)
    b_leaves, _ = pytree.tree_flatten(make_state(specs, device, "triton", **kw))
    for src, dst in zip(leaves, b_leaves):
        dst.copy_(src)
    b = pytree.tree_unflatten(b_leaves, pytree.tree_flatten(
        make_state(specs, device, "triton", **kw))[1])
    return a, b


def assert_same_state(a, b):
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        assert torch.equal(as_bytes(x), as_bytes(y))


def run_program(state, program, sources, launch):
    """Apply [("stash", name, n) | ("pop", name)] in order; returns popped outputs."""
    outs = []
    for op in program:
        if op[0] == "stash":
            n = torch.tensor([op[2]], dtype=torch.int32, device=state.flags.device)
            state = psf.stash(state, op[1], sources[op[1]], n, **launch)
        else:
            out, state = psf.pop(state, op[1], **launch)
            outs.append(out)
    return outs, state


def check_round_trip(out, src, n):
    n = max(0, min(n, src.shape[0]))
    assert torch.equal(as_bytes(out[:n]), as_bytes(src[:n]))
    assert not out[n:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 64, 1000, 7168])
def test_round_trip_twin_equals_kernel(device, dtype, width):
    page = 8
    capacity = 21 if width >= 1000 else 45     # not a multiple of the page
    gen = torch.Generator().manual_seed(width)
    specs = [psf.StashSpec("x", width, dtype, capacity, capacity),
             psf.StashSpec("y", width, dtype, capacity, capacity)]
    a, b = twin_pair(specs, device, page_size=page)
    sources = {s.name: random_rows(capacity, width, dtype, gen, device) for s in specs}
    n_x = capacity - 5
    program = [("stash", "x", n_x), ("stash", "y", capacity), ("pop", "y"), ("pop", "x")]
    launch = {"block": 2048 if width == 7168 else 0}
    outs_a, a = run_program(a, program, sources, {})
    outs_b, b = run_program(b, program, sources, launch)
    for oa, ob in zip(outs_a, outs_b):
        assert torch.equal(as_bytes(oa), as_bytes(ob))
    assert_same_state(a, b)
    check_round_trip(outs_b[0], sources["y"], capacity)
    check_round_trip(outs_b[1], sources["x"], n_x)
    # LIFO stash/pop restores the initial free lists exactly.
    fresh = make_state(specs, device, "torch", page_size=page)
    for lay in a.layouts:
        assert torch.equal(a.pools[lay.key].free_pages, fresh.pools[lay.key].free_pages)
        assert torch.equal(a.pools[lay.key].cursors, fresh.pools[lay.key].cursors)


@pytest.mark.parametrize("n", [0, 1, 16, 17, 64, 1000])
def test_row_counts_and_more_rows_than_programs(device, n):
    width, capacity, page = 24, 64, 16
    gen = torch.Generator().manual_seed(n)
    specs = [psf.StashSpec("x", width, torch.float32, capacity, capacity)]
    a, b = twin_pair(specs, device, page_size=page)
    src = {"x": random_rows(capacity, width, torch.float32, gen, device)}
    program = [("stash", "x", n)]
    _, a = run_program(a, program, src, {})
    _, b = run_program(b, program, src, {"programs": 2, "block": 64})   # 24 tiles, 2 programs
    assert_same_state(a, b)
    view = psf.table_view(b, "x")
    assert view["rows"] == min(n, capacity)
    assert len(view["pages"]) == math.ceil(min(n, capacity) / page)
    (out_a,), a = run_program(a, [("pop", "x")], src, {})
    (out_b,), b = run_program(b, [("pop", "x")], src, {"programs": 3, "block": 32})
    assert torch.equal(out_a, out_b)
    check_round_trip(out_b, src["x"], n)
    assert_same_state(a, b)


def test_shuffled_free_lists(device):
    width, capacity, page = 8, 50, 4
    specs = [psf.StashSpec(f"t{i}", width, torch.float16, capacity, capacity) for i in range(3)]
    a, b = twin_pair(specs, device, page_size=page, host_factor=0.5)
    gen = torch.Generator().manual_seed(3)
    for st in (a, b):
        for lay in st.layouts:
            free = st.pools[lay.key].free_pages
            cuda_perm = torch.randperm(lay.cuda_pages, generator=torch.Generator().manual_seed(1))
            host_perm = torch.randperm(lay.host_pages, generator=torch.Generator().manual_seed(2))
            free.copy_(torch.cat([free[:lay.cuda_pages][cuda_perm.to(free.device)],
                                  free[lay.cuda_pages:][host_perm.to(free.device)]]))
    sources = {s.name: random_rows(capacity, width, torch.float16, gen, device) for s in specs}
    program = [("stash", "t0", 50), ("stash", "t1", 13), ("pop", "t0"), ("stash", "t2", 37),
               ("pop", "t1"), ("pop", "t2")]
    outs_a, a = run_program(a, program, sources, {})
    outs_b, b = run_program(b, program, sources, {"programs": 5})
    for oa, ob in zip(outs_a, outs_b):
        assert torch.equal(oa, ob)
    assert_same_state(a, b)
    for out, (name, n) in zip(outs_b, [("t0", 50), ("t1", 13), ("t2", 37)]):
        check_round_trip(out, sources[name], n)


def test_cuda_pool_full_spills_to_host(device):
    width, capacity, page = 16, 64, 8
    # 1 balanced row per tensor: CUDA pool = ceil(0.5 * 2 / 8) + 2 = 3 pages;
    # host pool = ceil(64 * 2 / 8) + 2 = 18 pages.
    specs = [psf.StashSpec(n, width, torch.bfloat16, capacity, 1) for n in ("a", "b")]
    a, b = twin_pair(specs, device, page_size=page, cuda_factor=0.5, host_factor=64)
    lay = b.layouts[0]
    assert (lay.cuda_pages, lay.host_pages) == (3, 18)
    gen = torch.Generator().manual_seed(0)
    sources = {s.name: random_rows(capacity, width, torch.bfloat16, gen, device) for s in specs}
    program = [("stash", "a", 20), ("stash", "b", 60)]
    _, a = run_program(a, program, sources, {})
    _, b = run_program(b, program, sources, {"programs": 3})
    assert_same_state(a, b)
    flags = psf.read_flags(b)
    assert flags["host_spill"] and not flags["overflow"]
    va, vb = psf.table_view(b, "a"), psf.table_view(b, "b")
    assert va["cuda_pages"] == [0, 1, 2] and va["host_pages"] == []   # 20 rows: 3 CUDA pages
    assert vb["cuda_pages"] == [] and len(vb["host_pages"]) == 8      # all host
    outs_a, a = run_program(a, [("pop", "b"), ("pop", "a")], sources, {})
    outs_b, b = run_program(b, [("pop", "b"), ("pop", "a")], sources, {"programs": 3})
    assert_same_state(a, b)
    check_round_trip(outs_b[0], sources["b"], 60)
    check_round_trip(outs_b[1], sources["a"], 20)
    assert psf.pages_in_use(b)["bfloat16x16"]["cuda_used"] == 0


def test_split_across_cuda_and_host(device):
    width, capacity, page = 4, 40, 8
    specs = [psf.StashSpec("a", width, torch.float32, capacity, 8)]   # CUDA: ceil(8/8)+1 = 2
    a, b = twin_pair(specs, device, page_size=page, cuda_factor=1.0, host_factor=4.0)
    src = {"a": random_rows(capacity, width, torch.float32, torch.Generator(), device)}
    _, a = run_program(a, [("stash", "a", 40)], src, {})
    _, b = run_program(b, [("stash", "a", 40)], src, {"programs": 2})
    assert_same_state(a, b)
    view = psf.table_view(b, "a")
    assert view["cuda_pages"] == [0, 1] and view["host_pages"] == [0, 1, 2]
    (out,), b = run_program(b, [("pop", "a")], src, {})
    check_round_trip(out, src["a"], 40)


def test_overflow_is_sticky_and_pops_zeros(device):
    width, capacity, page = 8, 32, 8
    specs = [psf.StashSpec(n, width, torch.float32, capacity, 4) for n in ("a", "b", "c")]
    a, b = twin_pair(specs, device, page_size=page, cuda_factor=1.0)   # ceil(12/8)+3 = 5 pages
    gen = torch.Generator().manual_seed(0)
    sources = {s.name: random_rows(capacity, width, torch.float32, gen, device) for s in specs}
    # a takes 4 pages; b needs 4 with 1 free: overflow; c would fit (1 page) but copies nothing.
    program = [("stash", "a", 32), ("stash", "b", 25), ("stash", "c", 3)]
    _, a = run_program(a, program, sources, {})
    _, b = run_program(b, program, sources, {"programs": 2})
    assert_same_state(a, b)
    assert psf.read_flags(b)["overflow"] and not psf.read_flags(b)["host_spill"]
    assert psf.table_view(b, "b")["rows"] == layout.NOTHING_HELD
    assert psf.table_view(b, "c")["rows"] == layout.NOTHING_HELD
    assert psf.pages_in_use(b)["float32x8"]["cuda_used"] == 4
    program = [("pop", "c"), ("pop", "b"), ("pop", "a"), ("pop", "a")]
    outs_a, a = run_program(a, program, sources, {})
    outs_b, b = run_program(b, program, sources, {"programs": 2})
    assert_same_state(a, b)
    assert not outs_b[0].any() and not outs_b[1].any() and not outs_b[3].any()
    check_round_trip(outs_b[2], sources["a"], 32)
    assert psf.pages_in_use(b)["float32x8"]["cuda_used"] == 0
    assert psf.read_flags(b)["overflow"]            # sticky until reset
    b = psf.reset(b)
    assert not any(psf.read_flags(b).values())


def test_pop_never_returns_uninitialised_memory(device):
    # Pools full of NaN: a pop may only return stashed rows and zeros.
    width, capacity = 32, 40
    specs = [psf.StashSpec("a", width, torch.float32, capacity, capacity)]
    for backend in ("torch", "triton"):
        st = make_state(specs, device, backend, page_size=16)
        st.pools[st.layouts[0].key].cuda.fill_(float("nan"))
        src = torch.ones(capacity, width, device=device)
        st = psf.stash(st, "a", src, torch.tensor([17], device=device))
        out, st = psf.pop(st, "a")
        assert not out.isnan().any() and out.sum() == 17 * width


def test_ops_pass_opcheck(device):
    width, capacity = 16, 20
    specs = [psf.StashSpec("a", width, torch.float32, capacity, capacity)]
    for backend in ("torch", "triton"):
        # No host tier: opcheck clones its arguments, and a clone of a pinned host pool is not
        # pinned, which the CUDA kernel would refuse.
        st = make_state(specs, device, backend, page_size=8)
        table, cuda, host, free, cursors = psf.stash_slot(st, "a")
        flags = st.flags
        src = torch.randn(capacity, width, device=device)
        n = torch.tensor([13], device=device)
        torch.library.opcheck(psf.kernels.stash_copy,
                              (src, n, table, cuda, host, free, cursors, flags, 8, backend, 0, 0))
        # opcheck ran the stash several times on the same buffers; start the pop from a clean
        # stash so it has something to give back.
        st = psf.reset(st)
        table, cuda, host, free, cursors = psf.stash_slot(st, "a")
        flags = st.flags
        psf.kernels.stash_copy(src, n, table, cuda, host, free, cursors, flags, 8, backend, 0, 0)
        torch.library.opcheck(psf.kernels.stash_pop,
                              (table, cuda, host, free, cursors, capacity, 8, backend, 0, 0))


def test_bad_op_arguments_raise(device):
    specs = [psf.StashSpec("a", 8, torch.float32, 16, 16)]
    st = make_state(specs, device, "torch", page_size=8)
    with pytest.raises(ValueError, match=r"\[16, 8\]"):
        psf.stash(st, "a", torch.zeros(16, 9, device=device), torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="one-element integer"):
        psf.stash(st, "a", torch.zeros(16, 8, device=device), torch.tensor([1.0], device=device))
    with pytest.raises(KeyError, match="known: a"):
        psf.pop(st, "b")


def test_grid_is_one_program_per_tile_of_the_expected_rows():
    grid_size = _launcher("stash_copy").grid_size
    # 64 rows of width 24, pages of 16 rows, tiles of 64 elements: 6 tiles a page
    # a grid for 3/4 of the expected rows
    assert grid_size(64, 24, 16, 64, 1 << 31) == 24                   # no hint: the capacity
    assert grid_size(64, 24, 16, 64, 1 << 31, expected_rows=40) == 12  # 30 rows: 2 pages
    assert grid_size(64, 24, 16, 64, 1 << 31, expected_rows=43) == 18  # 33 rows: 3 pages
    assert grid_size(64, 24, 16, 64, 1 << 31, expected_rows=1000) == 24   # capped at capacity
    assert grid_size(64, 24, 16, 64, 5, expected_rows=40) == 5         # and at `programs`
    assert grid_size(640, 24, 16, 64, 1 << 31, expected_rows=1) == 60  # never under 1/4 of
    #                                                   the capacity: 160 rows, 10 pages
    assert grid_size(0, 24, 16, 64, 1 << 31, expected_rows=17) == 1


def _launcher(name):
    # the kernel modules by path: `psf.kernels.stash_copy` is the op of that name
    return sys.modules[f"pagedstash_func.kernels.{name}"]


@pytest.mark.parametrize("expected", [1, 17, 40, 64, 1000])
def test_a_grid_for_the_expected_rows_changes_no_bit(device, expected, monkeypatch):
    """The grid is sized from the spec's balanced rows: 40 valid rows above what it covers
    make programs loop over tiles, below it leave programs with nothing to copy; the same bits
    either way, through `psf.stash` and the layer's pop (no zero tail)."""
    width, capacity, page, n = 24, 64, 16, 40
    launch = {"block": 64, "programs": 1 << 20}       # a program per tile of the expected rows
    specs = [psf.StashSpec("x", width, torch.float32, capacity, expected)]
    # the pool is sized from the balanced rows too: make it hold the 40 rows
    a, b = twin_pair(specs, device, page_size=page, cuda_factor=max(1.1, 3 * n / expected))
    src = {"x": random_rows(capacity, width, torch.float32, torch.Generator().manual_seed(3),
                            device)}
    grids = []
    sizer = _launcher("stash_copy").grid_size
    for name in ("stash_copy", "stash_pop"):
        monkeypatch.setattr(_launcher(name), "grid_size",
                            lambda *args: grids.append(sizer(*args)) or grids[-1])
    _, a = run_program(a, [("stash", "x", n)], src, {})
    _, b = run_program(b, [("stash", "x", n)], src, launch)
    # 6 tiles a page; pages for 3/4 of the expected rows (at least 16, a quarter of the
    # capacity): 16, 16, 30, 48, then the capacity
    assert grids == [6 * {1: 1, 17: 1, 40: 2, 64: 3, 1000: 4}[expected]]
    assert_same_state(a, b)
    assert not b.flags.any()
    outs = [psf.kernels.stash_pop(*psf.stash_slot(st, "x"), capacity, page, backend, 64,
                                  1 << 20, 0, False, expected)
            for st, backend in ((a, "torch"), (b, "triton"))]
    assert torch.equal(outs[0][:n], outs[1][:n]) and torch.equal(outs[1][:n], src["x"][:n])
    assert_same_state(a, b)
    assert grids[1:] == grids[:1]       # the pop's grid, from the same expectation


def test_a_reservation_of_more_page_ids_than_one_step_moves(device):
    """The reservation (the stash copy's first launch) moves up to 4096 page ids a step:
    4500 pages take two; the same table, free lists and cursors as the twin."""
    capacity, page, n = 9000, 2, 8999
    specs = [psf.StashSpec("x", 1, torch.int32, capacity, capacity)]
    a, b = twin_pair(specs, device, page_size=page)
    count = torch.tensor([n], dtype=torch.int32, device=device)
    for st, backend in ((a, "torch"), (b, "triton")):
        psf.kernels.stash_reserve(count, *psf.stash_slot(st, "x"), st.flags, capacity, page,
                                  backend)
    assert_same_state(a, b)
    view = psf.table_view(b, "x")
    assert view["rows"] == n and len(view["pages"]) == 4500 and not b.flags.any()


@pytest.mark.parametrize("value, pdl", [
    (None, True), ("", True), ("0", True), ("no", True), (" False ", True),
    ("1", False), (" 1\n", False), ("TRUE", False), ("Yes", False),
    ("maybe", ValueError), ("2", ValueError), ("on", ValueError),
])
def test_the_pdl_switch_takes_one_or_zero(monkeypatch, value, pdl):
    """``PAGEDSTASH_NO_PDL`` is 1/true/yes (PDL off) or 0/false/no/empty (on); anything else
    is refused rather than read one way or the other. Asked for a CUDA device of capability
    9.0 (faked, so this runs without a GPU); never PDL off CUDA."""
    launch = _launcher("_launch")
    monkeypatch.setattr(launch, "_capability", lambda index: (9, 0))
    if value is None:
        monkeypatch.delenv(psf.kernels.PDL_OFF_ENV, raising=False)
    else:
        monkeypatch.setenv(psf.kernels.PDL_OFF_ENV, value)
    if pdl is ValueError:
        with pytest.raises(ValueError, match="set it to 1 to turn programmatic dependent"):
            psf.kernels.use_pdl(torch.device("cuda", 0))
        return
    assert psf.kernels.use_pdl(torch.device("cuda", 0)) is pdl
    assert psf.kernels.use_pdl(torch.device("cpu")) is False
    monkeypatch.setattr(launch, "_capability", lambda index: (8, 0))
    assert psf.kernels.use_pdl(torch.device("cuda", 0)) is False


full_tile_of_rows = _launcher("stash_copy").full_tile_of_rows


@triton.jit
def _full_tile_kernel(out_ptr, n, j, c, page_size, width, BLOCK: tl.constexpr):
    tl.store(out_ptr, full_tile_of_rows(n, j, c, page_size, width, BLOCK).to(tl.int32))


@pytest.mark.parametrize("n, j, c, page, width, block", [
    (0, 4687, 0, 64, 7168, 1024),       # -299968 rows x 7168 wraps an int32 to a positive
    (0, 4687, 447, 64, 7168, 1024),     # the last tile of a partial last page of 300000 rows
    (128, 1, 0, 64, 7168, 1024), (128, 2, 0, 64, 7168, 1024),
    (100, 1, 3, 64, 8, 64), (100, 1, 4, 64, 8, 64), (5, 0, 0, 4, 8, 32), (3, 0, 0, 4, 8, 32),
])
def test_the_first_tile_is_full_only_within_the_rows(device, n, j, c, page, width, block):
    """The page writer's test for a first tile it may load before the table is there, against
    exact integer arithmetic; capacities of 2^31 elements or more must not wrap it."""
    out = torch.full((1,), -1, dtype=torch.int32, device=device)
    _full_tile_kernel[(1,)](out, n, j, c, page, width, BLOCK=block)
    assert bool(out.item()) == (max(min(page, n - j * page), 0) * width - c * block >= block)


def test_the_writer_copies_the_rows_the_table_holds_when_its_count_moves(device):
    """The writer loads its first tile after the row count it reads at launch, which with PDL
    may come before the reserve's table is visible; it stores that tile only where the table
    holds the same rows. Here the count is a view of the table's first page-id slot, which the
    reserve overwrites (5 rows become page id 15): the pool must be what the twin writes."""
    page, width, capacity = 4, 8, 40
    src = torch.arange(capacity * width, dtype=torch.float32, device=device)
    src = src.reshape(capacity, width)

    def slot():
        table = torch.full((layout.table_size(capacity, page),), -1, dtype=torch.int32)
        table[layout.HEADER] = 5
        return [t.to(device) for t in (
            table, torch.full((16 * page, width), -7.0), torch.zeros(1, width),
            torch.arange(16, dtype=torch.int32), torch.tensor([16, 0, 0, 0], dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32))]
    twin, kernel = slot(), slot()
    count = slice(layout.HEADER, layout.HEADER + 1)     # the table's first page-id slot
    copy = _launcher("stash_copy")
    copy.stash_copy_reference(src, twin[0][count], *twin, page)
    copy.stash_copy_triton(src, kernel[0][count], *kernel, page, 32, 1 << 20, 4, 0)
    assert int(kernel[0][layout.TAB_ROWS]) == 5 and int(kernel[0][layout.HEADER]) == 15
    for a, b in zip(twin, kernel):
        assert torch.equal(a, b)


def test_launch_sizes_are_asked_per_kernel():
    cpu = torch.device("cpu")
    assert psf.kernels.choose_launch(cpu, 24, 4, 16, kernel="stash").block > 0
    with pytest.raises(ValueError, match="kernel must be one of"):
        psf.kernels.choose_launch(cpu, 24, 4, 16, kernel="copy")
    with pytest.raises(TypeError):
        psf.kernels.choose_launch(cpu, 24, 4, 16)     # no default: each kernel has its own


@pytest.mark.parametrize("n", [0, 5, 16, 37, 40])
def test_pop_without_zero_tail_gives_the_valid_rows_and_zeros_when_nothing_is_held(device, n):
    width, capacity, page = 24, 40, 8
    specs = [psf.StashSpec("x", width, torch.float32, capacity, capacity)]
    a, b = twin_pair(specs, device, page_size=page)
    src = random_rows(capacity, width, torch.float32, torch.Generator().manual_seed(n), device)
    outs = []
    for st, backend in ((a, "torch"), (b, "triton")):
        st = psf.stash(st, "x", src, torch.tensor([n], device=device))
        slot = psf.stash_slot(st, "x")
        outs.append(psf.kernels.stash_pop(*slot, capacity, page, backend, 0, 2, 0, False))
        # a second pop of the same table holds nothing: zeros, not garbage
        again = psf.kernels.stash_pop(*slot, capacity, page, backend, 0, 2, 0, False)
        assert not again.any()
        assert psf.pages_in_use(st)["float32x24"]["cuda_used"] == 0
    assert torch.equal(outs[0][:n], src[:n]) and torch.equal(outs[1][:n], src[:n])


def test_pop_with_a_smaller_capacity_gives_every_page_back(device):
    width, capacity, page = 8, 64, 8
    specs = [psf.StashSpec("x", width, torch.float32, capacity, capacity)]
    a, b = twin_pair(specs, device, page_size=page)
    src = random_rows(capacity, width, torch.float32, torch.Generator().manual_seed(3), device)
    for st, backend in ((a, "torch"), (b, "triton")):
        st = psf.stash(st, "x", src, torch.tensor([50], device=device))
        out = psf.kernels.stash_pop(*psf.stash_slot(st, "x"), 20, page, backend, 0, 1, 0, False)
        assert torch.equal(out, src[:20])
        assert psf.pages_in_use(st)["float32x8"]["cuda_used"] == 0
    assert_same_state(a, b)


def test_page_tables_too_short_for_the_rows_are_refused(device):
    specs = [psf.StashSpec("x", 8, torch.float32, 32, 32)]
    st = make_state(specs, device, "torch", page_size=8)
    slot = psf.stash_slot(st, "x")
    n = torch.tensor([4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="page table for 64 rows"):
        psf.kernels.stash_copy(torch.zeros(64, 8, device=device), n, *slot, st.flags, 8)
    with pytest.raises(ValueError, match="page table for 40 rows"):
        psf.kernels.stash_pop(*slot, 40, 8)


def test_bookkeeping_tensors_the_kernels_cannot_address_are_refused(device):
    specs = [psf.StashSpec("x", 8, torch.float32, 32, 32)]
    st = make_state(specs, device, "torch", page_size=8)
    slot = psf.stash_slot(st, "x")
    src = torch.zeros(32, 8, device=device)
    n = torch.tensor([4], dtype=torch.int32, device=device)
    strided = torch.stack([slot.table, slot.table], 1).reshape(-1)[::2]
    with pytest.raises(ValueError, match="contiguous int32"):
        psf.kernels.stash_copy(src, n, strided, *slot[1:], st.flags, 8)
    with pytest.raises(ValueError, match="contiguous int32"):
        psf.kernels.stash_pop(strided, *slot[1:], 32, 8)
    with pytest.raises(ValueError, match="flags must be"):
        psf.kernels.stash_copy(src, n, *slot, st.flags[:1], 8)
    with pytest.raises(ValueError, match="cursors must be"):
        psf.kernels.stash_copy(src, n, *slot[:4], torch.stack([slot.cursors] * 2, 1)[:, 0],
                               st.flags, 8)
    for bad in (n[:0], torch.tensor([4.0], device=device), torch.tensor([4, 4], device=device)):
        with pytest.raises(ValueError, match="n_rows must be"):
            psf.kernels.stash_reserve(bad, slot.table, slot.cuda, slot.host, slot.free_pages,
                                      slot.cursors, st.flags, 32, 8)
    with pytest.raises(ValueError, match="use the page size the pools were built with"):
        psf.kernels.stash_pop(slot.table, slot.cuda, slot.host, slot.free_pages, slot.cursors,
                              32, 16)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_counts_past_int32_clamp_to_the_capacity(device, backend):
    specs = [psf.StashSpec("x", 8, torch.float32, 32, 32)]
    st = make_state(specs, device, backend, page_size=8, cuda_factor=2.0)
    slot = psf.stash_slot(st, "x")
    src = torch.randn(32, 8, device=device)
    for count, held in ((2 ** 32 + 5, 32), (-2 ** 31 - 1, 0)):
        psf.kernels.stash_copy(src, torch.tensor([count], device=device), *slot, st.flags, 8,
                               backend)
        assert int(slot.table[0]) == held
        psf.kernels.stash_release(*slot, 8, backend)


def test_a_header_claiming_more_pages_than_its_slots_reads_nothing_past_them(device):
    leaves = []
    for backend in TRITON_BACKENDS:
        specs = [psf.StashSpec("x", 8, torch.float32, 32, 32)]
        st = make_state(specs, device, backend, page_size=8)
        slot = psf.stash_slot(st, "x")
        psf.kernels.stash_copy(torch.randn(32, 8, device=device),
                               torch.tensor([20], device=device), *slot, st.flags, 8, backend)
        header = slot.table[:layout.HEADER + 1].clone()      # rows 20, 3 pages, one slot
        psf.kernels.stash_release(header, *slot[1:], 8, backend)
        leaves.append([header, slot.free_pages.clone(), slot.cursors.clone()])
    for a, b in zip(*leaves) if len(leaves) == 2 else ():
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", ["alone", "word first", "word after"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_the_launch_floor_copies_as_its_twin(device, shape, dtype):
    """`bench stash --floor`'s bare copy, in each of its shapes, writes what its twin writes:
    every element (a last tile that is partial included) and the one-program launch's word."""
    src = random_rows(37, 29, dtype, torch.Generator().manual_seed(5), device)
    floor = _launcher("launch_floor")
    outs = []
    for copy in (floor.floor_copy_reference, floor.floor_copy_triton):
        out = torch.full_like(src, 3)
        word = torch.tensor([11, -1], dtype=torch.int32, device=device)
        copy(src, out, word, shape, *([64, 4] if copy is floor.floor_copy_triton else []))
        outs.append((out, word))
    (twin, twin_word), (kernel, kernel_word) = outs
    assert torch.equal(kernel, src) and torch.equal(as_bytes(kernel), as_bytes(twin))
    assert torch.equal(kernel_word, twin_word)
    assert kernel_word.tolist() == ([11, -1] if shape == "alone" else [11, 11])


def test_the_launch_floor_refuses_what_it_cannot_copy(device):
    floor = _launcher("launch_floor")
    src = torch.zeros(4, 8, device=device)
    word = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="shape must be one of"):
        floor.floor_copy_triton(src, torch.zeros_like(src), word, "word before", 64, 4)
    with pytest.raises(ValueError, match="out must match src"):
        floor.floor_copy_triton(src, torch.zeros(4, 8, dtype=torch.float16, device=device),
                                word, "alone", 64, 4)
    with pytest.raises(ValueError, match="must be contiguous"):
        floor.floor_copy_triton(src.t(), torch.zeros(4, 8, device=device).t(), word, "alone",
                                64, 4)
    with pytest.raises(ValueError, match="word must be a contiguous int32 tensor of at least 2"):
        floor.floor_copy_triton(src, torch.zeros_like(src), word[:1], "alone", 64, 4)
    spaced = torch.zeros(4, dtype=torch.int32, device=device)[::2]
    with pytest.raises(ValueError, match=r"\(not contiguous\)"):
        floor.floor_copy_triton(src, torch.zeros_like(src), spaced, "word after", 64, 4)
    for block, warps, text in ((48, 4, "block must be a power of two"),
                               (64.0, 4, "block must be a power of two"),
                               (64, 3, "warps must be a power of two"),
                               (64, 0, "warps must be a power of two")):
        with pytest.raises(ValueError, match=text):
            floor.floor_copy_triton(src, torch.zeros_like(src), word, "alone", block, warps)
    with pytest.raises(ValueError, match="programs must be an int >= 0"):
        floor.floor_copy_triton(src, torch.zeros_like(src), word, "alone", 64, 4, -1)


@pytest.mark.parametrize("programs", [1, 3, 16, 40])
def test_the_launch_floor_copies_every_tile_from_any_grid(device, programs, monkeypatch):
    """Fewer programs than tiles loop over them as the kernels' grid does (the first tile
    loaded before the wait, the rest after); more than tiles find nothing: every element
    arrives either way."""
    src = random_rows(31, 24, torch.float32, torch.Generator().manual_seed(7), device)
    out = torch.full_like(src, -1.0)
    word = torch.zeros(2, dtype=torch.int32, device=device)
    floor = _launcher("launch_floor")
    grids = []
    kernel = floor._flat_copy_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    monkeypatch.setattr(floor, "_flat_copy_kernel", Spy())
    floor.floor_copy_triton(src, out, word, "word first", 32, 4, programs)
    floor.floor_copy_triton(src, out, word, "alone", 32, 4)
    assert torch.equal(out, src) and word.tolist() == [0, 0]
    assert grids == [(programs,), (math.ceil(src.numel() / 32),)]   # 0: a program per tile
