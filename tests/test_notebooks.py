"""Every notebook executes end to end (on the CPU, in CI)."""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for cell in nb.cells for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


def _code_cells(path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_use_public_names_and_are_stored_with_their_outputs(path):
    """A notebook is read on GitHub as it is stored: every code cell ran and kept its output,
    none an error or a warning; and it imports only public names (no ``_module``, no
    ``_name``), as a user's notebook would."""
    import ast
    for cell in _code_cells(path):
        assert cell.execution_count is not None, f"{path.name}: a cell stored unexecuted"
        for out in cell.outputs:
            assert out.output_type != "error"
            assert not (out.output_type == "stream" and out.name == "stderr"), out.text[:300]
        for node in ast.walk(ast.parse(cell.source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "psf":
                names = [node.attr]
            private = [n for n in names if any(part.startswith("_") for part in n.split("."))]
            assert not private, f"{path.name} uses private {private}"
