"""kernels/ is pagedstash_func.kernels only; a bare `import kernels` from the checkout is inert."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent

PROBE = """
import sys, torch
import pagedstash_func as psf
import kernels                                   # what transformers' package probe does
assert kernels.__all__ == [] and not hasattr(kernels, "__version__"), vars(kernels).keys()
assert "kernels.stash_copy" not in sys.modules
st = psf.init_stash_state([psf.StashSpec("a", 4, torch.float32, 16, 16)],
                          psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=8))
src = torch.randn(16, 4)
st = psf.stash(st, "a", src, torch.tensor([5]))
out, st = psf.pop(st, "a")
assert torch.equal(out[:5], src[:5]) and not out[5:].any()
print("ok")
"""


def test_bare_kernels_import_from_the_checkout_is_inert():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok")


def test_installed_name_is_the_subpackage():
    import pagedstash_func.kernels as k
    assert k.__name__ == "pagedstash_func.kernels" and "stash_copy" in k.__all__
