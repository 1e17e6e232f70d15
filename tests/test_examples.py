"""The examples run as a user would run them, and reach what their docstrings promise."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_resnet_digits_trains_pipelined_as_well_as_without_the_pipeline():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "resnet_digits.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = dict(
        re.findall(
            r"^(pipelined|without the pipeline).*?test accuracy ([\d.]+)%", done.stdout, re.M
        )
    )
    assert set(found) == {"pipelined", "without the pipeline"}, done.stdout
    piped, plain = float(found["pipelined"]), float(found["without the pipeline"])
    print(done.stdout)
    assert piped >= 98.0
    assert abs(piped - plain) <= 1.0
