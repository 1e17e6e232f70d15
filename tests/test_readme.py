"""The README's examples run as written (the GPipe one with its CUDA devices swapped for CPU)."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def _example(marker: str) -> str:
    """The README's one Python example that contains ``marker``."""
    (code,) = [
        c for c in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if marker in c
    ]
    return code


def test_gpipe_example_runs():
    code = _example("gpipe.GPipe(layers")
    assert 'devices=["cuda:0", "cuda:1"]' in code
    code = re.sub(r'"cuda:\d"', '"cpu"', code)
    exec(compile(code, "README.md", "exec"), {})


def test_pipeline_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_example("gpipe.launch(train"))
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)


def test_skip_and_batchnorm_example_runs():
    exec(compile(_example("@skippable"), "README.md", "exec"), {})


def test_every_python_snippet_of_the_readme_and_the_guides_is_python():
    """The guides' snippets are fragments (they use names their prose defines), so only the
    README's run here; each of them must at least be Python a user can paste."""
    import ast

    guides = [README, *sorted((README.parent / "docs").glob("*.md"))]
    broken = []
    for path in guides:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            try:
                ast.parse(code)
            except SyntaxError as exc:
                broken.append(f"{path.name}, python block {i + 1}, line {exc.lineno}: {exc.msg}")
    assert not broken, broken
