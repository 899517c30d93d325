"""The package installs as one tree, and a script run from the checkout sees no folder of it
under another package's name (Hugging Face's ``kernels``, which transformers imports)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent

PROBE = """
import importlib.util, pathlib, sys
root = pathlib.Path.cwd().resolve()
for name in ("kernels", "core", "stash", "experts", "parallel", "layer", "step", "interop",
             "cli"):
    spec = importlib.util.find_spec(name)
    where = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), None))
    # a folder of the checkout's root answering the bare name (an installed package of that
    # name, in a virtual environment kept inside the checkout, is not one)
    assert not where or pathlib.Path(where).resolve() not in (root / name,
                                                              root / name / "__init__.py"), \
        (name, where)
print("ok")
"""


def _runs_from_root(code: str) -> None:
    """``code`` run by a fresh interpreter in the checkout's root ends well, printing ok."""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok")


def test_no_top_level_folder_of_the_checkout_shadows_another_package():
    """From the checkout's root (``python -m pagedstash_func`` there puts it first on
    ``sys.path``) no part of the package is importable by its bare name: a top-level
    ``kernels`` folder would answer transformers' ``from kernels import ...`` (transformers
    >= 5.25 installs Hugging Face's ``kernels``) and break every model it builds."""
    _runs_from_root(PROBE)


def test_a_transformers_model_builds_from_the_checkout_root():
    pytest.importorskip("transformers")
    probe = ("import transformers\n"
             "cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, "
             "intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1, "
             "num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, "
             "num_experts_per_tok=2)\n"
             "transformers.AutoModelForCausalLM.from_config(cfg)\n"
             "print('ok')\n")
    _runs_from_root(probe)


def test_installed_name_is_the_subpackage():
    import pagedstash_func.kernels as k
    assert k.__name__ == "pagedstash_func.kernels" and "stash_copy" in k.__all__


def package_folders():
    """Every folder of the package that holds an ``__init__.py``, as a dotted name."""
    found = set()
    for init in (ROOT / "pagedstash_func").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_every_package_folder_is_listed_for_the_wheel():
    import tomllib
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert package_folders() == set(listed), "pyproject.toml [tool.setuptools] packages and the " \
        "package folders differ: add the new folder to the list"


def test_a_built_wheel_holds_and_imports_every_subpackage(tmp_path):
    """Built and unpacked away from the checkout (an editable install would hide a package
    missing from the wheel), every subpackage imports and the command line starts."""
    import shutil
    import zipfile
    src = tmp_path / "src"           # a clean copy: a stale build/ would fill in a missing package
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        "build", "dist", "site", "*.egg-info", ".git", ".venv", ".whl", "__pycache__",
        ".pytest_cache", ".hypothesis", "notebooks", "docs"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel, = tmp_path.glob("pagedstash_func-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    names = sorted(package_folders())
    probe = ("import importlib, sys\n"
             f"for name in {names!r}:\n"
             "    mod = importlib.import_module(name)\n"
             f"    assert mod.__file__.startswith({str(site)!r}), mod.__file__\n"
             "import pagedstash_func as psf\n"
             "assert psf.kernels.stash_copy and psf.stash_aware\n"
             "from pagedstash_func.cli._demo import corpus\n"
             "assert len(corpus()) > 1000\n"
             "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok")
    cli = subprocess.run([sys.executable, "-m", "pagedstash_func", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert cli.returncode == 0 and "bench" in cli.stdout, cli.stderr[-2000:]


WITHOUT_TRITON = """
import sys
class NoTriton:                      # as on macOS or Windows, where no Triton wheel exists
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTriton())
"""


def test_the_package_runs_without_triton():
    """Triton is a Linux-only dependency: without it the package imports, a capacity step with
    the stash runs on the torch twins and equals the exact path, asking for the Triton backend
    says why it cannot, and the demo trains."""
    code = WITHOUT_TRITON + """
import torch, pagedstash_func as psf
assert "triton" not in sys.modules and not psf.kernels._triton.AVAILABLE
g = torch.Generator().manual_seed(0)
params = psf.moe_init(8, 16, 24, generator=g, dtype=torch.float64)
batch = {"x": torch.randn(32, 16, generator=g, dtype=torch.float64)}
def loss_fn(p, b):
    return psf.moe(p, b["x"], top_k=2).square().mean()
step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0, paged_stash=True,
                                                page_size=8))
res = psf.run_step(step, params, batch, step.init(params, batch))
ref = torch.func.grad(loss_fn)(params, batch)
assert not res.report.reran
for k in ref:
    torch.testing.assert_close(res.grads[k], ref[k], rtol=1e-12, atol=1e-14)
try:
    psf.kernels.gather_rows(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64),
                            torch.tensor([4]), backend="triton")
    raise SystemExit("the Triton backend ran without Triton")
except ValueError as err:
    assert "Triton is not installed" in str(err), err
import runpy
sys.argv = ["pagedstash_func", "demo", "--steps", "3"]
try:
    runpy.run_module("pagedstash_func", run_name="__main__")
except SystemExit as done:
    assert not done.code, done.code
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items()
                                           if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok"), run.stdout[-2000:]
