"""`bench stash --anchor`: the anchor's kernels are read out of a Megatron-LM checkout without
running the rest of its module, and anything else is a `ValueError` that names the fix.

The timing itself needs CUDA graphs (GPU only); these tests hold the loader to its contract on
a stand-in checkout whose module would fail if it were imported.
"""

import os
import textwrap

import pytest

from pagedstash_func._bench_anchor import ANCHOR_FILE, COPY_ARGS, POP_ARGS, load_anchor


def _kernel(name, args):
    params = ", ".join(f"{a}: tl.constexpr" if a.isupper() else a for a in args)
    return f"@triton.jit\ndef {name}({params}):\n    pid = tl.program_id(axis=0)\n"


def _checkout(tmp_path, body):
    path = tmp_path / ANCHOR_FILE
    path.parent.mkdir(parents=True)
    path.write_text(body)
    return str(tmp_path)


# Module-level code that must not run: Megatron's own imports, and a raise.
HEADER = textwrap.dedent("""\
    import triton
    import triton.language as tl
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    raise RuntimeError("the anchor's module was executed")
    """)


def test_reads_both_kernels_without_running_the_module(tmp_path):
    body = HEADER + _kernel("_paged_stash_copy_kernel", COPY_ARGS) + "\n" \
        + _kernel("_paged_stash_pop_kernel", POP_ARGS) + "\nclass Other:\n    pass\n"
    kernels = load_anchor(_checkout(tmp_path, body))
    assert list(kernels["_paged_stash_copy_kernel"].arg_names) == list(COPY_ARGS)
    assert list(kernels["_paged_stash_pop_kernel"].arg_names) == list(POP_ARGS)


def test_a_folder_without_the_anchor_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="Megatron-LM checkout"):
        load_anchor(str(tmp_path))


def test_a_missing_kernel_is_named(tmp_path):
    body = HEADER + _kernel("_paged_stash_copy_kernel", COPY_ARGS)
    with pytest.raises(ValueError, match="_paged_stash_pop_kernel"):
        load_anchor(_checkout(tmp_path, body))


def test_changed_arguments_are_refused(tmp_path):
    body = HEADER + _kernel("_paged_stash_copy_kernel", COPY_ARGS[:-1]) + "\n" \
        + _kernel("_paged_stash_pop_kernel", POP_ARGS)
    with pytest.raises(ValueError, match="the anchor changed"):
        load_anchor(_checkout(tmp_path, body))


def test_a_file_that_is_not_python_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not Python"):
        load_anchor(_checkout(tmp_path, "def broken(:\n"))
    os.remove(tmp_path / ANCHOR_FILE)
    for junk in (b"\x00\x01", b"\xff\xfe not utf-8"):
        (tmp_path / ANCHOR_FILE).write_bytes(junk)
        with pytest.raises(ValueError, match="not Python"):
            load_anchor(str(tmp_path))


def _pop_with(decorator="@triton.jit", first="cuda_src_ptr", last="BLOCK_SIZE: tl.constexpr"):
    middle = ", ".join(f"{a}: tl.constexpr" if a.isupper() else a for a in POP_ARGS[1:-1])
    return f"{decorator}\ndef _paged_stash_pop_kernel({first}, {middle}, {last}):\n    pass\n"


@pytest.mark.parametrize("pop", [
    _pop_with(decorator='@__import__("os").system("echo pwned")\n@triton.jit'),
    _pop_with(last='BLOCK_SIZE: tl.constexpr = __import__("os").getcwd()'),
    _pop_with(first='cuda_src_ptr: print("pwned")'),
])
def test_a_def_that_would_run_code_is_refused(tmp_path, pop, capfd):
    """Decorators, defaults and annotations run when a def does: only triton.jit and
    tl.constexpr are let through."""
    body = HEADER + _kernel("_paged_stash_copy_kernel", COPY_ARGS) + "\n" + pop
    with pytest.raises(ValueError, match="plain @triton.jit"):
        load_anchor(_checkout(tmp_path, body))
    assert "pwned" not in capfd.readouterr().out
