"""`bench stash --anchor`: Megatron-Core's paged-stash kernels timed beside ours, in one process.

Megatron-Core (the project's public anchor) keeps its paged-stash copy and pop kernels in
``megatron/core/transformer/moe/paged_stash.py`` of a Megatron-LM checkout. That module imports
half of Megatron (its optimizer, its CUDA-graph wrapper), so instead of importing it this reads
the two ``@triton.jit`` functions out of the file (``ast``: the file is parsed, not run), writes
them alone into a temporary module beside ``import triton`` and imports that. Nothing of
Megatron ships with this package: the user points ``--anchor`` at their own checkout.

The anchor is timed at both of its launch settings, ``(BLOCK_SIZE, programs)`` = (1024, 2048)
(its default) and (4096, 8192) (its SM 10.x setting), twice each: the kernel alone, and as its
launcher runs it, where a second launch (a ``copy_`` of the new free-list head or tail)
publishes what the kernel computed; ours publishes inside the kernel.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import tempfile

import torch

from ._bench import graph_seconds

ANCHOR_FILE = os.path.join("megatron", "core", "transformer", "moe", "paged_stash.py")
SETTINGS = ((1024, 2048), (4096, 8192))    # (BLOCK_SIZE, most programs)
COPY_ARGS = (
    "src_ptr", "cuda_dst_ptr", "host_dst_ptr", "num_tokens_ptr", "free_list_cuda_ptr",
    "free_list_host_ptr", "free_list_head_ptr", "free_list_tail_ptr", "free_list_capacity_ptr",
    "page_record_ptr", "overflow_ptr", "host_spill_global_ptr", "spilled_to_host_ptr",
    "new_free_list_head_ptr", "PAGE_SIZE", "HIDDEN_SIZE", "BLOCK_SIZE", "HAS_HOST_BUFFER")
POP_ARGS = (
    "cuda_src_ptr", "host_src_ptr", "dst_ptr", "num_tokens_ptr", "page_record_ptr",
    "spilled_to_host_ptr", "overflow_ptr", "free_list_cuda_ptr", "free_list_host_ptr",
    "free_list_tail_ptr", "free_list_capacity_ptr", "new_free_list_tail_ptr", "PAGE_SIZE",
    "HIDDEN_SIZE", "BLOCK_SIZE")
KERNELS = {"_paged_stash_copy_kernel": COPY_ARGS, "_paged_stash_pop_kernel": POP_ARGS}


def load_anchor(root: str) -> dict:
    """``{name: triton kernel}`` of the anchor's copy and pop kernels, read from the
    Megatron-LM checkout at ``root``; `ValueError` naming the fix when they are not there or
    their arguments are not the ones this bench passes."""
    path = os.path.join(root, ANCHOR_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--anchor {root!r}: no {ANCHOR_FILE} there; pass the root of a "
                         f"Megatron-LM checkout that has the paged stash (its dev branch)")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError) as err:      # UnicodeDecodeError is a ValueError
        raise ValueError(f"--anchor: {path} is not Python this interpreter can parse: "
                         f"{err}") from None
    found = {node.name: node for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name in KERNELS}
    for name, expected in KERNELS.items():
        if name not in found:
            raise ValueError(f"--anchor: {path} defines no {name}; this bench knows the "
                             f"paged stash of Megatron-LM's dev branch (2025-2026)")
        args = tuple(a.arg for a in found[name].args.args)
        if args != expected:
            raise ValueError(f"--anchor: {name} in {path} takes {args}, not the {expected} "
                             f"this bench passes: the anchor changed; update _bench_anchor")
        _check_def_runs_nothing(found[name], path)
    module = ast.Module(body=[*ast.parse("import triton\nimport triton.language as tl").body,
                              *found.values()], type_ignores=[])
    # Triton reads a kernel's source through `inspect`, so the module must be a real file.
    out = tempfile.NamedTemporaryFile("w", suffix="_anchor_paged_stash.py", delete=False)
    with out:
        out.write(ast.unparse(module))
    try:
        spec = importlib.util.spec_from_file_location("_anchor_paged_stash", out.name)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)     # triton.jit keeps the source it read
    finally:
        os.remove(out.name)
    return {name: getattr(loaded, name) for name in KERNELS}


def _check_def_runs_nothing(node: ast.FunctionDef, path: str) -> None:
    """`ValueError` unless defining ``node`` evaluates nothing but ``triton.jit`` and
    ``tl.constexpr``: a decorator, a default or an annotation is run when the def is, so only
    those two are let through. The body runs only as a Triton kernel, as Megatron runs it:
    point ``--anchor`` at a checkout you would import."""
    def is_attr(expr, owner, attr):
        return isinstance(expr, ast.Attribute) and expr.attr == attr \
            and isinstance(expr.value, ast.Name) and expr.value.id == owner
    args = node.args
    plain = not (args.posonlyargs or args.kwonlyargs or args.vararg or args.kwarg
                 or args.defaults or args.kw_defaults or node.returns)
    notes = all(a.annotation is None or is_attr(a.annotation, "tl", "constexpr")
                for a in args.args)
    decorated = len(node.decorator_list) == 1 and is_attr(node.decorator_list[0], "triton",
                                                           "jit")
    if not (plain and notes and decorated):
        raise ValueError(f"--anchor: {node.name} in {path} is not a plain @triton.jit kernel "
                         f"(only tl.constexpr annotations, no defaults): refusing to define it")


def measure_anchor(kernels: dict, hidden: int, rows: int, dtype: torch.dtype, page_size: int,
                   iters: int, device: torch.device, valid: float = 1.0) -> dict:
    """Ratios to ``copy_`` of the anchor's stash and pop of ``rows`` valid rows (of a buffer of
    ``ceil(rows / valid)``), the best of its two launch settings: ``stash_kernel`` /
    ``pop_kernel`` for the kernel alone, ``stash_launched`` / ``pop_launched`` with the
    publishing ``copy_`` added. Raises if a round trip loses data."""
    capacity = math.ceil(rows / valid)
    pages = -(-capacity // page_size)
    i64 = dict(dtype=torch.int64, device=device)
    src = torch.randn(capacity, hidden, device=device).to(dtype)
    pool = torch.empty(pages * page_size, hidden, dtype=dtype, device=device)
    out = torch.empty_like(src)
    dst = torch.empty_like(src[:rows])
    n = torch.tensor([rows], **i64)
    free_cuda, free_host = torch.arange(pages, **i64), torch.empty(0, **i64)
    head, tail, cap = torch.zeros(2, **i64), torch.tensor([pages, 0], **i64), \
        torch.tensor([pages, 0], **i64)
    record, overflow, spill_any, spilled = (torch.zeros(pages, **i64), torch.zeros(1, **i64),
                                            torch.zeros(1, **i64), torch.zeros(1, **i64))
    new_head, new_tail = torch.empty(2, **i64), torch.empty(2, **i64)
    t_copy = graph_seconds(lambda: dst.copy_(src[:rows]), iters)
    # The kernels write the new head / tail beside the live one, so a replay repeats the same
    # work; the publishing copy_ is timed alone (replaying it would drain the free list).
    t_publish = graph_seconds(lambda: new_tail.copy_(new_head), iters)
    best = dict(stash_kernel=0.0, pop_kernel=0.0, stash_launched=0.0, pop_launched=0.0)
    for block, programs in SETTINGS:
        grid = (max(1, min(capacity, programs)),)

        def stash():
            kernels["_paged_stash_copy_kernel"][grid](
                src, pool, pool, n, free_cuda, free_host, head, tail, cap, record, overflow,
                spill_any, spilled, new_head, PAGE_SIZE=page_size, HIDDEN_SIZE=hidden,
                BLOCK_SIZE=block, HAS_HOST_BUFFER=0)

        def pop():
            kernels["_paged_stash_pop_kernel"][grid](
                pool, pool, out, n, record, spilled, overflow, free_cuda, free_host, tail, cap,
                new_tail, PAGE_SIZE=page_size, HIDDEN_SIZE=hidden, BLOCK_SIZE=block)

        out.zero_()
        stash(), pop()
        torch.cuda.synchronize()
        if not torch.equal(out[:rows], src[:rows]) or overflow.item():
            raise RuntimeError(f"the anchor's stash/pop round trip lost data at {hidden} x "
                               f"{rows} (BLOCK_SIZE {block})")
        t_stash, t_pop = graph_seconds(stash, iters), graph_seconds(pop, iters)
        for key, seconds in (("stash_kernel", t_stash), ("pop_kernel", t_pop),
                             ("stash_launched", t_stash + t_publish),
                             ("pop_launched", t_pop + t_publish)):
            best[key] = max(best[key], t_copy / seconds)
    return best
