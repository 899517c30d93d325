"""`bench stash --anchor`: Megatron-Core's paged-stash kernels timed beside ours, in one process.

Megatron-Core (the project's public anchor) keeps its paged-stash copy and pop kernels in a
Megatron-LM checkout: ``megatron/core/transformer/moe/ops/paged_stash.py`` (``paged_stash_*``,
2026) or, earlier, ``megatron/core/transformer/moe/paged_stash.py`` (``_paged_stash_*``, 2025).
Those modules import much of Megatron, so instead of importing one this reads the two
``@triton.jit`` functions out of the file with ``ast``, writes them alone into a temporary
module beside ``import triton`` and imports that. Nothing of Megatron ships with this package:
the user points ``--anchor`` at their own checkout.

This runs code from that checkout: Triton compiles the kernel bodies, and its compiler calls
the Python functions a body names. The loader lets through only plain ``@triton.jit``
definitions whose bodies call nothing but ``tl.*``, ``range`` and ``.to`` and touch no private
attribute; that narrows what a file can do, it is not a sandbox. Point ``--anchor`` at a
checkout you would import.

The anchor is timed at both of its launch settings, ``(BLOCK_SIZE, programs)`` = (1024, 2048)
(its default) and (4096, 8192) (its SM 10.x setting), twice each: the kernel alone, and as its
launcher runs it, where a second launch (a ``copy_`` of the new free-list head or tail)
publishes what the kernel computed (newer launchers also zero the page record before a copy:
not counted); ours publishes inside the kernel. Its pop runs without zeroing the padded tail,
as ours does.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import shutil
import sys
import tempfile

import torch

from ._common import graph_seconds

_MOE = os.path.join("megatron", "core", "transformer", "moe")
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
POP_TAIL_ARGS = ("MAX_NUM_TOKENS", "ZERO_PADDED_TOKENS")     # the 2026 pop's tail option
# (file, copy kernel, pop kernel, the pop signatures seen there), newest first. Megatron-LM's
# public history (read at d98e8a6) has the copy's one signature at both paths and the pop
# without the tail option at both; a pop with it (MAX_NUM_TOKENS, ZERO_PADDED_TOKENS) is
# accepted too, and then run without zeroing the tail, as ours.
LAYOUTS = (
    (os.path.join(_MOE, "ops", "paged_stash.py"), "paged_stash_copy_kernel",
     "paged_stash_pop_kernel", (POP_ARGS, POP_ARGS + POP_TAIL_ARGS)),
    (os.path.join(_MOE, "paged_stash.py"), "_paged_stash_copy_kernel",
     "_paged_stash_pop_kernel", (POP_ARGS, POP_ARGS + POP_TAIL_ARGS)),
)


def load_anchor(root: str) -> dict:
    """``{"copy": kernel, "pop": kernel, "pop_tail": bool, "commit": str}``: the anchor's copy
    and pop kernels read from the Megatron-LM checkout at ``root`` (``pop_tail``: its pop
    takes the tail option; ``commit``: the checkout's commit, or ``"unknown"`` outside git);
    `ValueError` naming the fix when they are not there, their arguments are none of the
    signatures this bench knows, or a definition does more than define a kernel."""
    for relative, copy_name, pop_name, pop_signatures in LAYOUTS:
        path = os.path.join(root, relative)
        if os.path.isfile(path):
            break
    else:
        raise ValueError(f"--anchor {root!r}: neither {LAYOUTS[0][0]} nor {LAYOUTS[1][0]} "
                         f"there; pass the root of a Megatron-LM checkout that has the paged "
                         f"stash")
    try:
        with open(path, "rb") as f:          # bytes: Python honours a BOM or coding cookie
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError, RecursionError, MemoryError) as err:
        raise ValueError(f"--anchor: {path} is not Python this interpreter can parse: "
                         f"{type(err).__name__}: {err}") from None
    kernels = {copy_name: (COPY_ARGS,), pop_name: pop_signatures}
    found = {node.name: node for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name in kernels}
    for name, known in kernels.items():
        if name not in found:
            raise ValueError(f"--anchor: {path} defines no {name}; this bench knows the "
                             f"paged stash of Megatron-LM 2025-2026")
        args = tuple(a.arg for a in found[name].args.args)
        if args not in known:
            raise ValueError(f"--anchor: {name} in {path} takes {args}, none of the "
                             f"signatures this bench knows ({list(known)}): the anchor "
                             f"changed; update pagedstash_func/cli/bench/_anchor.py")
        _check_def_runs_nothing(found[name], path)
        _check_body(found[name], path)
    pop_args = tuple(a.arg for a in found[pop_name].args.args)
    try:
        loaded = _import_kernels([found[copy_name], found[pop_name]])
    except (SyntaxError, RecursionError, MemoryError) as err:   # parses, does not compile
        raise ValueError(f"--anchor: {path} does not compile: {type(err).__name__}: "
                         f"{err}") from None
    return {"copy": getattr(loaded, copy_name), "pop": getattr(loaded, pop_name),
            "pop_tail": pop_args != POP_ARGS, "commit": _commit_of(root)}


def _commit_of(root: str) -> str:
    """The checkout's commit (short), read by git without running anything of the checkout's;
    ``"unknown"`` where ``root`` is not a git work tree or git is missing."""
    import subprocess
    def git(*args):
        out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""
    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(root):
            return "unknown"          # not a checkout of its own (a copy inside another repo)
        return git("describe", "--always", "--dirty", "--abbrev=10") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _import_kernels(defs):
    """Import ``defs`` from a file in a private temporary folder (Triton reads a kernel's
    source through `inspect`, so the module must be a real file), writing no bytecode: nothing
    is read from or left in a shared ``__pycache__``; the folder is gone afterwards."""
    module = ast.Module(body=[*ast.parse("import triton\nimport triton.language as tl").body,
                              *defs], type_ignores=[])
    source = ast.unparse(module)
    folder = tempfile.mkdtemp(prefix="psf_anchor_")      # mode 0700: no one else writes here
    name = os.path.join(folder, "anchor_paged_stash.py")
    no_bytecode = sys.dont_write_bytecode
    try:
        with open(name, "w", encoding="utf-8") as out:
            out.write(source)
        sys.dont_write_bytecode = True
        spec = importlib.util.spec_from_file_location("_anchor_paged_stash", name)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)     # triton.jit keeps the source it read
    finally:
        sys.dont_write_bytecode = no_bytecode
        shutil.rmtree(folder, ignore_errors=True)
    return loaded


_REFUSED_NODES = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.FunctionDef,
                  ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.With, ast.Try,
                  ast.Delete, ast.Await, ast.Yield, ast.YieldFrom)


def _check_body(node: ast.FunctionDef, path: str) -> None:
    """`ValueError` unless the body of ``node`` names only its own arguments and locals,
    ``tl`` and ``range``, calls only ``tl.*``, ``range`` and ``.to``, and reads no attribute
    that starts with an underscore: what the anchor's kernels need, and little else."""
    try:
        _check_body_nodes(node, path)
    except RecursionError:
        raise ValueError(f"--anchor: {node.name} in {path} nests too deeply to check") from None


def _check_body_nodes(node: ast.FunctionDef, path: str) -> None:
    known = {a.arg for a in node.args.args} | {"tl", "range"}
    known |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)}
    for sub in (n for stmt in node.body for n in ast.walk(stmt)):
        bad = None
        if isinstance(sub, _REFUSED_NODES):
            bad = type(sub).__name__
        elif isinstance(sub, ast.Name) and sub.id not in known:
            bad = f"the name {sub.id!r}"
        elif isinstance(sub, ast.Attribute) and sub.attr.startswith("_"):
            bad = f"the attribute {sub.attr!r}"
        elif isinstance(sub, ast.Call):
            f = sub.func
            ok = (isinstance(f, ast.Name) and f.id == "range") or (
                isinstance(f, ast.Attribute) and (
                    f.attr == "to" or (isinstance(f.value, ast.Name) and f.value.id == "tl")))
            bad = None if ok else f"a call of {ast.unparse(f)!r}"
        if bad:
            raise ValueError(f"--anchor: {node.name} in {path} uses {bad} (line "
                             f"{getattr(sub, 'lineno', '?')}); a paged-stash kernel needs only "
                             f"tl.*, range and .to: refusing to compile it")


def _check_def_runs_nothing(node: ast.FunctionDef, path: str) -> None:
    """`ValueError` unless defining ``node`` evaluates nothing but ``triton.jit`` and
    ``tl.constexpr``: a decorator, a default or an annotation is run when the def is, so only
    those two are let through (the body is `_check_body`'s)."""
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
                   iters: int, device: torch.device, valid: float = 1.0,
                   copy_seconds: float | None = None) -> dict:
    """Ratios to ``copy_`` of the anchor's stash and pop of ``rows`` valid rows (of a buffer of
    ``ceil(rows / valid)``), the best of its two launch settings: ``stash_kernel`` /
    ``pop_kernel`` for the kernel alone, ``stash_launched`` / ``pop_launched`` with the
    publishing ``copy_`` added. ``copy_seconds``: the ``copy_`` time our kernels were read
    against (timed here when not given), so that ours over the anchor is a ratio of times.
    Raises if a round trip loses data."""
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
    t_copy = copy_seconds or graph_seconds(lambda: dst.copy_(src[:rows]), iters)
    tail_option = dict(MAX_NUM_TOKENS=capacity, ZERO_PADDED_TOKENS=False) \
        if kernels["pop_tail"] else {}
    # The kernels write the new head / tail beside the live one, so a replay repeats the same
    # work; the publishing copy_ is timed alone (replaying it would drain the free list).
    t_publish = graph_seconds(lambda: new_tail.copy_(new_head), iters)
    best = dict(stash_kernel=0.0, pop_kernel=0.0, stash_launched=0.0, pop_launched=0.0)
    for block, programs in SETTINGS:
        grid = (max(1, min(capacity, programs)),)

        def stash():
            kernels["copy"][grid](
                src, pool, pool, n, free_cuda, free_host, head, tail, cap, record, overflow,
                spill_any, spilled, new_head, PAGE_SIZE=page_size, HIDDEN_SIZE=hidden,
                BLOCK_SIZE=block, HAS_HOST_BUFFER=0)

        def pop():
            kernels["pop"][grid](
                pool, pool, out, n, record, spilled, overflow, free_cuda, free_host, tail, cap,
                new_tail, PAGE_SIZE=page_size, HIDDEN_SIZE=hidden, BLOCK_SIZE=block,
                **tail_option)

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
