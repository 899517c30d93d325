"""The code in README.md and docs/ runs as written, on the CPU, so the docs cannot drift from
the code.

Every ```python block of a page runs, in page order, in one fresh namespace per page (like a
notebook). A block that cannot run here (it needs CUDA, or several processes under torchrun)
carries a marker on the line before its fence that says why and names the test that runs the
same code:

    <!-- skip: needs CUDA; runs in tests/test_graph_gpu.py::test_replay_does_not_sync -->

The reference pages must name every public name, the README's usage example keeps its
contract (a scalar loss, gradients per parameter), and the README's figures are those of
BENCHMARKS.md.
"""

import pathlib
import re
import sys
import textwrap
import types

import pytest
import torch

import pagedstash_func as psf

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[^\s`]*)[^\n]*\n"
                   r"(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
PYTHON = {"python", "py", "python3"}
MARKER = re.compile(r"<!--\s*skip\b(?P<rest>.*?)-->", re.S)
SKIP = re.compile(r"^:\s*(?P<why>[^;]*\S)\s*;\s*runs in\s+"
                  r"(?P<file>tests/[\w/]+\.py)::(?P<test>\w+)\s*$")


def blocks(page: pathlib.Path):
    """``(line, lang, code, marker)`` of each fenced block: ``line`` is the 1-based line of
    its first code line; ``marker`` the text of a ``<!-- skip ... -->`` on the line before the
    fence (``None`` if there is none)."""
    text = page.read_text()
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(before.strip())
        lang = "python" if m["lang"] in PYTHON else m["lang"]
        yield (text.count("\n", 0, m.start()) + 2, lang, textwrap.dedent(m["body"]),
               marker["rest"] if marker else None)


def python_pages():
    return [p for p in PAGES if any(lang == "python" for _, lang, _, _ in blocks(p))]


def name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def run_page(page: pathlib.Path) -> dict:
    """Run the page's python blocks in order in one namespace (a module of its own while they
    run, as a notebook's is: torch.compile looks up the module of what it traces); returns
    the namespace."""
    module = types.ModuleType(f"docs.{page.stem}")
    scope = module.__dict__
    sys.modules[module.__name__] = module
    try:
        for line, lang, code, marker in blocks(page):
            if lang == "python" and marker is None:
                # padded so that a traceback names the page's own line numbers
                exec(compile("\n" * (line - 1) + code, name(page), "exec"), scope)
    finally:
        del sys.modules[module.__name__]
    return scope


@pytest.mark.parametrize("page", python_pages(), ids=name)
def test_page_code_runs(page):
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        scope = run_page(page)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    if page.name == "README.md":
        text = page.read_text()
        assert re.search(r"^## Use\n\n```python\n", text, re.M), "README keeps a ## Use example"
        res = scope["res"]
        assert res.loss.ndim == 0 and set(res.grads[0]) == {"router", "w_gate_up", "w_down"}


def test_every_skipped_block_says_why_and_names_a_test_that_runs_it():
    for page in PAGES:
        for line, lang, _, marker in blocks(page):
            if marker is None:
                continue
            where = f"{name(page)}:{line - 2}"
            m = SKIP.match(marker)
            assert m, (f"{where}: write the marker as <!-- skip: <why>; runs in "
                       f"tests/<file>.py::<test> -->, got <!-- skip{marker}-->")
            assert lang == "python", f"{where}: a skip marker belongs before a python block"
            test_file = ROOT / m["file"]
            assert test_file.is_file(), f"{where}: {m['file']} does not exist"
            assert re.search(rf"^\s*def {m['test']}\(", test_file.read_text(), re.M), \
                f"{where}: {m['file']} has no test {m['test']}"


def test_reference_documents_every_public_name():
    text = "\n".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    documented = set(re.findall(r"^::: (pagedstash_func\.[\w.]+)", text, re.M))
    # a kernel op named as its file is documented from there (kernels.stash_copy.stash_copy):
    # ``kernels.stash_copy`` alone is the module, which the op's name shadows at run time
    documented = {re.sub(r"^(pagedstash_func\.kernels)\.(\w+)\.\2$", r"\1.\2", d)
                  for d in documented}
    # likewise psf.stash, the function, whose name the subpackage stash/ takes in griffe's
    # eyes: documented from its module (pagedstash_func.stash._paging.stash)
    documented = {"pagedstash_func.stash" if d == "pagedstash_func.stash._paging.stash" else d
                  for d in documented}
    wanted = {f"pagedstash_func.{n}" for n in psf.__all__ if n != "kernels"}
    wanted |= {f"pagedstash_func.kernels.{n}" for n in psf.kernels.__all__}
    assert not wanted - documented, f"not in docs/reference: {sorted(wanted - documented)}"
    assert not documented - wanted, f"not public: {sorted(documented - wanted)}"


def test_readme_figures_are_those_of_the_benchmarks_record():
    """Every number in the README's table beside transformers is in BENCHMARKS.md, where its
    command, machine and commit are."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Beside transformers", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    figures = re.findall(r"\d+(?:\.\d+)?", table)
    assert len(figures) > 10, "the README keeps its table of figures beside transformers"
    record = (ROOT / "BENCHMARKS.md").read_text()
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", record)]
    assert not missing, f"README figures not in BENCHMARKS.md: {missing}"
