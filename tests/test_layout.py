"""The layering of README's Layout section holds: imports only run downward, no module
imports another module's private name, and the CLI uses public names only."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent / "pagedstash_func"

FLOORS = {
    "_config": 0, "_interop": 0, "kernels": 0,
    "_state": 1, "_routing": 1, "_symmetric": 1,
    "_pools": 2, "_paging": 2,
    "_experts": 3, "_dispatch": 3, "_frame": 3, "_call": 3, "_validate": 3,
    "_comm": 4, "_expert_parallel": 5, "_moe": 6, "_transform": 7, "_runner": 8,
    "_profile": 9, "_replay": 9, "_graph": 9,
}
CLI = {"__main__", "_demo", "_demo_stash", "_bench", "_bench_stash", "_bench_moe",
       "_bench_peer", "_bench_memory", "_bench_ep", "_bench_anchor"}


def relative_imports(path):
    """(module imported, names imported) for every ``from .x import ...`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                yield node.module, [a.name for a in node.names]
            else:
                for a in node.names:
                    yield a.name, []


def test_imports_run_downward_and_take_no_private_names():
    for path in ROOT.glob("*.py"):
        me = path.stem
        if me == "__init__":
            continue
        for module, names in relative_imports(path):
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{me} imports private {private} from {module}"
            if me in CLI:
                assert module in CLI, f"the CLI module {me} imports {module}: use psf names"
                continue
            assert me in FLOORS, f"{me} has no floor in the Layout section"
            assert FLOORS[module] < FLOORS[me], f"{me} (floor {FLOORS[me]}) imports {module} " \
                                               f"(floor {FLOORS[module]})"


def test_each_kernel_file_is_self_contained():
    """A kernel file imports the shared helper modules (``_layout``, ``_pagestack``, ...),
    never another kernel file."""
    kernels = ROOT.parent / "kernels"
    for path in kernels.glob("*.py"):
        if path.stem.startswith("_"):
            continue
        for module, _ in relative_imports(path):
            assert module.startswith("_"), f"kernels/{path.name} imports the kernel {module}"
