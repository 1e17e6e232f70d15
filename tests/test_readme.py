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


# The guides (docs/*.md) below: what they name exists, and their fragments run.

GUIDES = [README, *sorted((README.parent / "docs").glob("*.md"))]
COMMANDS = ("train", "sample", "generate", "export", "simulate", "plan", "bench", "view")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# ``gpipe plan ...`` in a code block (continued lines joined) or in a backticked span
COMMAND_LINE = re.compile(r"gpipe(?:\.cli)? (" + "|".join(COMMANDS) + r")\b([^#`\n]*)")


def _command_lines(text: str) -> list[tuple[str, str]]:
    blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [b.replace("\\\n", " ") for b in blocks] + re.findall(r"`([^`]+)`", prose)
    return [m.groups() for span in spans for m in COMMAND_LINE.finditer(span)]


def test_every_flag_a_guide_gives_a_command_is_one_of_that_command():
    """``gpipe plan --suggest ...`` in a guide: each ``--flag`` is in ``gpipe plan --help``."""
    import contextlib
    import io

    from gpipe.cli import main

    known = {}
    for command in COMMANDS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([command, "--help"])
        known[command] = set(FLAG.findall(out.getvalue()))
    unknown = [
        f"{path.name}: gpipe {command} {flag}"
        for path in GUIDES
        for command, rest in _command_lines(path.read_text())
        for flag in FLAG.findall(rest)
        if flag not in known[command]
    ]
    assert not unknown, unknown


def test_every_dotted_gpipe_name_in_the_guides_exists():
    """``gpipe.planning.advice.bubble``, ``gpipe.schedules.from_csv``: as test_design_map
    checks of docs/design.md, for the README and every guide (file names such as a
    checkpoint's ``gpipe.json`` aside)."""
    from tests.test_design_map import DOTTED, _resolve

    missing = []
    for path in GUIDES:
        for name in sorted({m.group(0) for m in DOTTED.finditer(path.read_text())}):
            if name == "gpipe.json":
                continue
            try:
                _resolve(name)
            except (ImportError, AttributeError):
                missing.append(f"{path.name}: {name}")
    assert not missing, missing


def _guide_block(page: str, marker: str, fence: str = "python") -> str:
    """The one ``fence`` block of docs/``page`` that contains ``marker``."""
    text = (README.parent / "docs" / page).read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    (code,) = [c for f, c in blocks if f == fence and marker in c]
    return code


def _cli_output(argv: list[str]) -> str:
    import contextlib
    import io

    from gpipe.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_the_simulate_table_of_schedules_md_is_what_the_command_prints():
    command = _guide_block("schedules.md", "gpipe simulate --stages 4 --chunks 8\n", "bash")
    shown = _guide_block("schedules.md", "makespan  bubble  formula", "")
    assert _cli_output(command.split()[1:]) == shown


def test_the_rule_of_thumb_note_of_memory_md_is_what_plan_prints():
    """The note for --chunks 8 on 4 stages (default checkpoint except_last), and the bubble
    with ``never`` that the page quotes beside it."""
    note = _guide_block("memory.md", "note: --chunks 8 is below", "").strip()
    small = ["plan", "--n-layer", "4", "--d-model", "32", "--n-head", "2", "--seq-len", "16"]
    assert _cli_output([*small, "--stages", "4", "--chunks", "8"]).splitlines()[-1] == note
    never = _cli_output([*small, "--stages", "4", "--chunks", "8", "--checkpoint", "never"])
    assert "bubble is 27.3%" in never.splitlines()[-1]
    assert "27.3 % with `never`" in (README.parent / "docs" / "memory.md").read_text()


# Each guide fragment with what its prose assumes defined (tiny sizes), run on 2 processes.
_TINY = """
import torch, gpipe
from torch import nn
import torch.nn.functional as F
from gpipe.models import GPTConfig, build_gpt, lm_loss
torch.manual_seed(0)
layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
loss_fn = nn.functional.mse_loss
x, y = torch.randn(8, 4), torch.randn(8, 4)
config = GPTConfig(n_layer=4, d_model=16, n_head=2, vocab_size=32, seq_len=80)
tokens = torch.randint(32, (8, 17))
"""
_GPT_PIPE = "pipe = gpipe.Pipeline(build_gpt(config), [3, 3], chunks=2, loss_fn=lm_loss)\n"
# Left out for time: schedules.md's seq_split and generation.md's generate (about 3 s each).
_FRAGMENTS = [  # (page, marker, what the prose defines before it, a use after it)
    ("schedules.md", 'schedule="1f1b", loss_fn=loss_fn)', "", "pipe.step(x, y)"),
    ("schedules.md", 'schedule="interleaved"', "", "pipe.step(x, y)"),
    ("schedules.md", 'schedule="zero-bubble-v"', "", "pipe.step(x, y)"),
    ("schedules.md", 'schedule="v-half"', "", "pipe.step(x, y)"),
    (
        "step.md",
        "return_outputs=True)",
        "y = torch.randint(4, (8,)); pipe = gpipe.Pipeline("
        "layers, [4, 4], chunks=2, loss_fn=F.cross_entropy)",
        "",
    ),
    (
        "step.md",
        "microbatches = [(tokens[:, :7]",
        _GPT_PIPE + "tokens, labels = tokens[:, :-1], "
        "tokens[:, 1:]; long_tokens, long_labels = tokens[:2], labels[:2]",
        "",
    ),
    (
        "step.md",
        "from gpipe.runtime import Layers",
        "from gpipe import Pipeline\nfrom gpipe.models import Block\nlayers = build_gpt(config)",
        "",
    ),
    (
        "varlen.md",
        "pipe.step(microbatches=[(x0, y0)",
        "pipe = gpipe.Pipeline(layers, [4, 4], "
        "loss_fn=loss_fn); x0, y0, x1, y1, x2, y2 = x[:2], y[:2], x[2:3], y[2:3], x[3:], y[3:]",
        "",
    ),
    (
        "varlen.md",
        "counts=counts_of(microbatches)",
        _GPT_PIPE + "sequences = [[t % 32 for t in "
        "range(1, n)] for n in (5, 9, 17, 30, 12, 3, 40, 7, 22, 11)]",
        "",
    ),
    (
        "varlen.md",
        "pipe.forward_only(input_ids",
        _GPT_PIPE + "input_ids, targets = tokens[:, :-1]"
        ", tokens[:, 1:]; x0, y0, x1, y1 = input_ids[:2], targets[:2], input_ids[2:], targets[2:]",
        "",
    ),
    ("varlen.md", "g = torch.Generator().manual_seed(0)", "from gpipe.data import plan", ""),
    (
        "memory.md",
        "from gpipe.planning import plan\n",
        "sample, target, balance = x[:2], y[:2], [4, 4]",
        "",
    ),
    (
        "memory.md",
        "sub_sequence_carry",
        "layers = build_gpt(config); seq_len = 16; balance = [3, 3]",
        "",
    ),
    (
        "view.md",
        "from gpipe.planning import Costs",
        "pipe = gpipe.Pipeline(layers, [4, 4], "
        "chunks=8, loss_fn=loss_fn, trace=True); pipe.step(x, y)\n"
        "open('zbv.csv', 'w').write('0F0,0B0\\n1F0,1B0\\n')",
        "",
    ),
]


def _run_fragments(folder: str) -> list[str]:
    """Each fragment in a fresh namespace, in ``folder``; the ones that raised, by page."""
    import os
    import traceback

    failed, cwd = [], os.getcwd()
    os.chdir(folder)
    try:
        for page, marker, before, after in _FRAGMENTS:
            code = "\n".join([_TINY, before, _guide_block(page, marker), after])
            try:
                exec(compile(code, f"{page} ({marker})", "exec"), {"__name__": "guide"})
            except Exception:
                failed.append(f"{page} ({marker}): {traceback.format_exc()}")
    finally:
        os.chdir(cwd)
    return failed


def test_the_guides_python_fragments_run_with_what_their_prose_defines(tmp_path):
    """The schedules, step, varlen, memory and view guides' fragments, on one
    shared pair of processes: a guide that drifts from the API fails here."""
    from tests.workers import run

    results = run(_run_fragments, 2, (str(tmp_path),), threads=1)
    assert results == {0: [], 1: []}, results
    assert {"page.html", "step.html", "file.html"} <= {p.name for p in tmp_path.iterdir()}
