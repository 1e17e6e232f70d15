"""``gpipe.launch`` (and ``gpipe.training.train``, which launches through it) from a script
read from standard input, whose main module names a file that does not exist."""

import sys

from gpipe import launch

from . import launch_cases


def test_a_script_read_from_standard_input_launches(monkeypatch):
    """``python - < script.py`` sets ``__main__.__file__`` to ``"<stdin>"``; the started
    processes, which import the caller's main module from its file, must not try to run it
    (each failed with FileNotFoundError: '<stdin>'), and the caller keeps its name."""
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None)
    monkeypatch.setattr(main, "__file__", "<stdin>", raising=False)
    assert launch(launch_cases.threads, 1, threads=2) == {0: 2}
    assert main.__file__ == "<stdin>"
