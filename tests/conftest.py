"""Test set-up: without CUDA, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined, i.e. before
pagedstash_func is imported, so it is set here at collection time.

Test files sit in folders that mirror the package (``core/``, ``stash/``, ..., ``kernel/`` for
``pagedstash_func/kernels/``); the folders have no ``__init__``, so this folder is on ``sys.path`` and its
helpers (``worlds``, ``moe_reference``, this file) import by name. ``kernel/`` is singular
because a ``kernels`` folder here would answer transformers' probe for the hub package of that
name.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # cuBLAS is deterministic only with a fixed workspace (read when its handle is created).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402

# Triton runs on the CPU only under the interpreter, which is process-wide; on a GPU machine the
# kernels compile for CUDA, so the device-parametrised tests run there instead.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
TRITON_BACKENDS = ["torch", "triton"] if (torch.cuda.is_available()
                                          or os.environ.get("TRITON_INTERPRET") == "1") \
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
