"""Test set-up: without CUDA, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined, i.e. before
pagedstash_func is imported, so it is set here at collection time.

Test files sit in folders that mirror the package (``core/``, ``stash/``, ..., ``kernel/`` for
``pagedstash_func/kernels/``); the folders have no ``__init__``, so this folder is on ``sys.path`` and its
helpers (``worlds``, ``moe_reference``, this file) import by name. ``kernel/`` is singular
because a ``kernels`` folder here would answer transformers' probe for the hub package of that
name.
"""

import importlib.util
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist each worker takes a core: one thread each (and in the processes it
    # starts, which read this at their torch import), or the workers' thread pools fight
    # over the same cores and every test slows down several times over.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # cuBLAS is deterministic only with a fixed workspace (read when its handle is created).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402

# Triton runs on the CPU only under the interpreter, which is process-wide; on a GPU machine the
# kernels compile for CUDA, so the device-parametrised tests run there instead.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
# Triton has wheels for Linux only: without it the kernels' Triton tests skip, and the torch
# twins (what the package runs there) are still held to the reference.
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_BACKENDS = ["torch", "triton"] if HAS_TRITON and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1") else ["torch"]
# for tests that run the kernels on CPU tensors: Triton there needs the interpreter, which is
# set only where there is no GPU (on a GPU machine the kernels compile for CUDA instead)
CPU_BACKENDS = ["torch", "triton"] if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1" \
    else ["torch"]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes (so NaN garbage in unwritten memory compares bit for bit)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say why tests skipped, grouped by reason (most of them need CUDA: on a GPU machine
    they run), so a green run's skips are not a mystery."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{count:4d}  {reason}")
