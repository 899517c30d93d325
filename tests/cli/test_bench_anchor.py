"""`bench stash --anchor`: the anchor's kernels are read out of a Megatron-LM checkout without
running the rest of its module, and anything else is a `ValueError` that names the fix.

The timing itself needs CUDA graphs (GPU only); these tests hold the loader to its contract on
stand-in checkouts whose modules would fail if they were imported.
"""

import textwrap

import pytest

pytest.importorskip("triton", reason="the anchor's kernels are Triton's (Linux only)")

from pagedstash_func.cli.bench._anchor import (
    COPY_ARGS, LAYOUTS, POP_ARGS, POP_TAIL_ARGS, load_anchor,
)

OLD, NEW = LAYOUTS[1], LAYOUTS[0]      # (file, copy name, pop name, pop signatures)
REAL, TAIL = POP_ARGS, POP_ARGS + POP_TAIL_ARGS   # Megatron-LM's pop, and one with the tail


def _params(args):
    return ", ".join(f"{a}: tl.constexpr" if a.isupper() else a for a in args)


def _kernel(name, args, body="pid = tl.program_id(axis=0)"):
    return f"@triton.jit\ndef {name}({_params(args)}):\n    {body}\n"


def _checkout(tmp_path, body, layout=OLD):
    path = tmp_path / layout[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return str(tmp_path)


# Module-level code that must not run: Megatron's own imports, and a raise.
HEADER = textwrap.dedent("""\
    import triton
    import triton.language as tl
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    raise RuntimeError("the anchor's module was executed")
    """)


def _both(layout=OLD, pop_body="pid = tl.program_id(axis=0)", pop_args=REAL):
    _, copy_name, pop_name, _ = layout
    return HEADER + _kernel(copy_name, COPY_ARGS) + "\n" + _kernel(pop_name, pop_args, pop_body) \
        + "\nclass Other:\n    pass\n"


@pytest.mark.parametrize("pop_args", [REAL, TAIL], ids=["megatron-lm", "with-tail"])
@pytest.mark.parametrize("layout", [OLD, NEW], ids=["moe/paged_stash.py", "moe/ops/"])
def test_reads_every_known_signature_at_either_path_without_running_the_module(
        tmp_path, layout, pop_args):
    """Megatron-LM's own signatures (read from its public history: the copy's one signature,
    the pop without the tail option, at both paths; d98e8a6 is ops/ with that pop) and a pop
    with the tail option are all accepted; the commit is read where it is a git checkout."""
    kernels = load_anchor(_checkout(tmp_path, _both(layout, pop_args=pop_args), layout))
    assert list(kernels["copy"].arg_names) == list(COPY_ARGS)
    assert list(kernels["pop"].arg_names) == list(pop_args)
    assert kernels["pop_tail"] == (pop_args == TAIL)
    assert kernels["commit"] == "unknown"                        # not a git checkout


def test_the_checkouts_commit_is_recorded(tmp_path):
    import subprocess
    root = _checkout(tmp_path, _both(NEW), NEW)
    git = ["git", "-C", root, "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "anchor"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert load_anchor(root)["commit"] == head


def test_the_newer_layout_wins_when_both_are_there(tmp_path):
    _checkout(tmp_path, _both(OLD), OLD)
    assert load_anchor(_checkout(tmp_path, _both(NEW, pop_args=TAIL), NEW))["pop_tail"]


def test_the_real_kernels_bodies_pass(tmp_path):
    """Bodies written like the anchor's: loops, masks, .to, a ternary, `iter` as a name."""
    body = textwrap.indent(textwrap.dedent("""\
        pid = tl.program_id(axis=0)
        n = tl.load(num_tokens_ptr)
        token = pid
        while token < n:
            base = src_ptr + token.to(tl.int64) * HIDDEN_SIZE
            for iter in range(tl.cdiv(HIDDEN_SIZE, BLOCK_SIZE)):
                offs = tl.arange(0, BLOCK_SIZE) + iter * BLOCK_SIZE
                tl.store(dst_ptr + offs, tl.load(base + offs, mask=offs < HIDDEN_SIZE, other=0))
            token += tl.num_programs(axis=0) if HIDDEN_SIZE > 0 and n > 0 else 1
        """), "    ").strip()
    pop = _kernel(NEW[2], REAL, body.replace("src_ptr", "cuda_src_ptr"))
    text = HEADER + _kernel(NEW[1], COPY_ARGS) + "\n" + pop
    assert load_anchor(_checkout(tmp_path, text, NEW))["pop"] is not None


def test_a_folder_without_the_anchor_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="Megatron-LM checkout"):
        load_anchor(str(tmp_path))


def test_a_missing_kernel_is_named(tmp_path):
    body = HEADER + _kernel(OLD[1], COPY_ARGS)
    with pytest.raises(ValueError, match=OLD[2]):
        load_anchor(_checkout(tmp_path, body))


def test_changed_arguments_are_refused(tmp_path):
    body = HEADER + _kernel(OLD[1], COPY_ARGS[:-1]) + "\n" + _kernel(OLD[2], POP_ARGS)
    with pytest.raises(ValueError, match="none of the signatures this bench knows"):
        load_anchor(_checkout(tmp_path, body))


def test_a_file_that_is_not_python_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not Python"):
        load_anchor(_checkout(tmp_path, "def broken(:\n"))
    for junk in (b"\x00\x01", b"\xff\xfe not utf-8"):
        (tmp_path / OLD[0]).write_bytes(junk)
        with pytest.raises(ValueError, match="not Python"):
            load_anchor(str(tmp_path))


def _pop_with(decorator="@triton.jit", first="cuda_src_ptr", last="BLOCK_SIZE: tl.constexpr"):
    middle = _params(POP_ARGS[1:-1])
    return f"{decorator}\ndef {OLD[2]}({first}, {middle}, {last}):\n    pass\n"


@pytest.mark.parametrize("pop", [
    _pop_with(decorator='@__import__("os").system("echo pwned")\n@triton.jit'),
    _pop_with(last='BLOCK_SIZE: tl.constexpr = __import__("os").getcwd()'),
    _pop_with(first='cuda_src_ptr: print("pwned")'),
])
def test_a_def_that_would_run_code_is_refused(tmp_path, pop, capfd):
    """Decorators, defaults and annotations run when a def does: only triton.jit and
    tl.constexpr are let through."""
    body = HEADER + _kernel(OLD[1], COPY_ARGS) + "\n" + pop
    with pytest.raises(ValueError, match="plain @triton.jit"):
        load_anchor(_checkout(tmp_path, body))
    assert "pwned" not in capfd.readouterr().out


@pytest.mark.parametrize("line,what", [
    ('getattr(triton.runtime.cache.os, "system")("echo pwned")', "a call of .getattr"),
    ('x = getattr(tl, "load")', "a call of 'getattr'"),
    ("x = triton.runtime", "name 'triton'"),
    ("x = tl.load.__globals__", "attribute '__globals__'"),
    ("x = cuda_src_ptr.__class__", "attribute '__class__'"),
    ("import os", "Import"),
    ("x = (lambda: 0)()", "a call of"),
    ("x = [lambda: 0]", "Lambda"),
    ('x = tl.load(cuda_src_ptr).foo("pwned")', "a call of"),
])
def test_a_body_that_calls_outside_tl_is_refused(tmp_path, line, what):
    """Triton's compiler calls the Python functions a kernel body names: a body may name its
    arguments and locals, tl and range, and call tl.*, range and .to only."""
    with pytest.raises(ValueError, match=what):
        load_anchor(_checkout(tmp_path, _both(OLD, pop_body=line)))


def test_no_file_or_bytecode_is_left_behind(tmp_path, monkeypatch):
    """The module is written to a private folder and imported without bytecode: nothing is
    read from or left in a shared __pycache__ (a planted .pyc there would run instead)."""
    import glob
    import sys
    import tempfile
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    root = tempfile.gettempdir()
    before = set(glob.glob(f"{root}/psf_anchor_*")) | set(
        glob.glob(f"{root}/**/*anchor_paged_stash*", recursive=True))
    load_anchor(_checkout(tmp_path, _both(OLD)))
    after = set(glob.glob(f"{root}/psf_anchor_*")) | set(
        glob.glob(f"{root}/**/*anchor_paged_stash*", recursive=True))
    assert after == before and sys.dont_write_bytecode is False


def test_a_bom_or_a_coding_cookie_is_still_python(tmp_path):
    for head in (b"\xef\xbb\xbf", b"# -*- coding: latin-1 -*-\n"):
        path = tmp_path / OLD[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(head + _both(OLD).encode())
        assert load_anchor(str(tmp_path))["pop"] is not None


@pytest.mark.parametrize("body,what", [
    ("break", "does not compile"),                     # parses, fails to compile
    ("x = " + "-" * 100000 + "1", "parse|nests too deeply|compile"),
])
def test_broken_or_pathological_bodies_are_a_value_error(tmp_path, body, what):
    with pytest.raises(ValueError, match=what):
        load_anchor(_checkout(tmp_path, _both(OLD, pop_body=body)))
