"""StashState: sizing, pytree, consumption, reset, and page invariants under random programs."""

import math

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedstash_func as psf
from pagedstash_func.kernels import layout


def cfg(**kw):
    base = dict(capacity_factor=1.0, paged_stash=True, page_size=8)
    base.update(kw)
    return psf.StashConfig(**base)


def test_pool_sizing_follows_the_balanced_reference():
    specs = [psf.StashSpec("a", 16, torch.bfloat16, 100, 50),
             psf.StashSpec("b", 16, torch.bfloat16, 100, 30),
             psf.StashSpec("c", 32, torch.float32, 100, 10)]
    state = psf.init_stash_state(specs, cfg(cuda_factor=1.1, host_factor=0.5))
    by_key = {lay.key: lay for lay in state.layouts}
    # bf16 x16: ceil(1.1 * 80 / 8) + 2 = 11 + 2; host: ceil(0.5 * 80 / 8) + 2 = 5 + 2.
    assert (by_key[(torch.bfloat16, 16)].cuda_pages, by_key[(torch.bfloat16, 16)].host_pages) \
        == (13, 7)
    # f32 x32: ceil(11 / 8) + 1 = 3; host ceil(5 / 8) + 1 = 2.
    assert (by_key[(torch.float32, 32)].cuda_pages, by_key[(torch.float32, 32)].host_pages) \
        == (3, 2)
    assert state.pools[(torch.bfloat16, 16)].cuda.shape == (13 * 8, 16)
    no_host = psf.init_stash_state(specs, cfg())
    assert all(lay.host_pages == 0 for lay in no_host.layouts)


def test_negative_factor_uses_observed_rows():
    specs = [psf.StashSpec("a", 4, torch.float32, 100, 50, observed_rows=70)]
    state = psf.init_stash_state(specs, cfg(cuda_factor=-1.5, host_factor=-1.0))
    assert state.layouts[0].cuda_pages == math.ceil(105 / 8) + 1
    assert state.layouts[0].host_pages == math.ceil(70 / 8) + 1
    with pytest.raises(ValueError, match="profiling pass"):
        psf.init_stash_state([psf.StashSpec("a", 4, torch.float32, 100, 50)],
                             cfg(cuda_factor=-1.0))


def test_duplicate_names_and_bad_specs_raise():
    spec = psf.StashSpec("a", 4, torch.float32, 10, 10)
    with pytest.raises(ValueError, match="unique"):
        psf.init_stash_state([spec, spec], cfg())
    with pytest.raises(ValueError, match="width >= 1"):
        psf.init_stash_state([psf.StashSpec("a", 0, torch.float32, 10, 10)], cfg())


def test_state_is_a_pytree_with_static_context():
    specs = [psf.StashSpec("a", 4, torch.float32, 10, 10)]
    state = psf.init_stash_state(specs, cfg(), counts={"moe0": 5})
    leaves, spec = pytree.tree_flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    again = pytree.tree_unflatten(leaves, spec)
    assert isinstance(again, psf.StashState) and again.specs == state.specs
    assert again.counts["moe0"].shape == (5,)
    # Leaf order is the documented one: flags, then each pool's four tensors, tables, counts.
    assert leaves[0] is state.flags and leaves[-1] is state.counts["moe0"]
    assert all(a is b for a, b in zip(leaves[1:5], state.pools[state.layouts[0].key]))


def test_consumed_state_is_refused_with_the_fix():
    specs = [psf.StashSpec("a", 4, torch.float32, 10, 10)]
    state = psf.init_stash_state(specs, cfg())
    src = torch.randn(10, 4)
    new = psf.stash(state, "a", src, torch.tensor([3]))
    with pytest.raises(psf.ConsumedStateError, match="already consumed by stash") as err:
        psf.stash(state, "a", src, torch.tensor([3]))
    assert "state.clone()" in str(err.value)
    spare = new.clone()
    out1, _ = psf.pop(new, "a")
    out2, _ = psf.pop(spare, "a")
    assert torch.equal(out1, out2) and torch.equal(out1[:3], src[:3])


def test_reset_restores_initial_page_order():
    specs = [psf.StashSpec(n, 4, torch.float32, 32, 16) for n in "abc"]
    state = psf.init_stash_state(specs, cfg(host_factor=1.0))
    fresh = [t.clone() for t in pytree.tree_leaves(state)[1:]]
    state = psf.stash(state, "a", torch.randn(32, 4), torch.tensor([30]))
    state = psf.stash(state, "b", torch.randn(32, 4), torch.tensor([9]))
    _, state = psf.pop(state, "a")            # out of LIFO order: free list now permuted
    state = psf.reset(state)
    leaves = pytree.tree_leaves(state)
    assert not leaves[0].any()
    pool = state.pools[state.layouts[0].key]
    assert torch.equal(pool.free_pages, fresh[2]) and torch.equal(pool.cursors, fresh[3])
    assert all(psf.table_view(state, n)["rows"] == layout.NOTHING_HELD for n in "abc")


# ----------------------------------------------------------------------------- property test

PROGRAM = st.lists(st.tuples(st.sampled_from(["stash", "pop"]), st.integers(0, 3),
                             st.integers(0, 40)), min_size=1, max_size=25)


def check_invariants(state, held):
    for lay in state.layouts:
        pool = state.pools[lay.key]
        cur = pool.cursors.tolist()
        free = pool.free_pages.tolist()
        free_ids = free[:cur[0]] + free[lay.cuda_pages:lay.cuda_pages + cur[1]]
        owned = []
        for spec in state.specs:
            view = psf.table_view(state, spec.name)
            if spec.name in held:
                assert view["rows"] == held[spec.name]
                assert len(view["pages"]) == math.ceil(held[spec.name] / state.page_size)
            else:
                assert view["rows"] == layout.NOTHING_HELD
            owned += view["pages"]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        everything = sorted(owned + free_ids)
        assert everything == list(range(lay.cuda_pages + lay.host_pages)), "page lost or doubled"


@settings(max_examples=60, deadline=None)
@given(program=PROGRAM, backend=st.sampled_from(["torch", "torch", "triton"]))
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU pools; Triton there needs the interpreter")
def test_random_interleavings_keep_page_invariants(program, backend):
    names = ["a", "b", "c", "d"]
    specs = [psf.StashSpec(n, 3, torch.float32, 40, 10) for n in names]
    # ceil(40 / 4) + 4 = 14 CUDA pages, ceil(20 / 4) + 4 = 9 host pages: overflow reachable.
    state = psf.init_stash_state(specs, cfg(page_size=4, cuda_factor=1.0, host_factor=0.5,
                                            backend=backend))
    sources = {n: torch.randn(40, 3) for n in names}
    held, overflowed = {}, False
    for op, which, n in program:
        name = names[which]
        if op == "stash" and name not in held:
            need = math.ceil(n / 4)
            cur = state.pools[state.layouts[0].key].cursors.tolist()
            fits = not overflowed and need <= cur[0] + cur[1]
            state = psf.stash(state, name, sources[name], torch.tensor([n]))
            if fits:
                held[name] = n
            else:
                overflowed = True
        elif op == "pop":
            out, state = psf.pop(state, name)
            n_held = held.pop(name, 0)
            assert torch.equal(out[:n_held], sources[name][:n_held]) and not out[n_held:].any()
        check_invariants(state, held)
        assert psf.read_flags(state)["overflow"] == overflowed
    for name in list(held):
        _, state = psf.pop(state, name)
        held.pop(name)
    check_invariants(state, held)
    cur = state.pools[state.layouts[0].key].cursors.tolist()
    assert cur[:2] == [14, 9], "every page is free again once everything is popped"


def test_a_pool_past_int32_page_ids_is_refused():
    """Page ids, free lists and cursors are int32: a factor that asks for more pages is a
    ValueError naming the factors, not an allocator failure or an overflow."""
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, host_factor=1e12)
    with pytest.raises(ValueError, match="page ids are int32"):
        psf.init_stash_state([psf.StashSpec("x", 64, torch.float32, 100, 100)], cfg)
