"""The README's usage example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    block = re.search(r"## Use\n\n```python\n(.*?)```", text, re.S).group(1)
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)
    res = scope["res"]
    assert res.loss.ndim == 0 and set(res.grads[0]) == {"router", "w_gate_up", "w_down"}
