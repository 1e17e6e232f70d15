"""``TrainConfig``, the flags of ``gpipe train`` as a dataclass: field for flag with the same
defaults, its TOML form (``--config``, ``--print-config``), and the one-line errors for a
configuration that cannot run, alike from the command and from ``train`` (nothing here starts
a process; tests/cli/test_train.py runs configurations)."""

import argparse
import dataclasses
import re

import pytest

from gpipe.cli import main
from gpipe.cli.train import add_parser, config_of
from gpipe.errors import ConfigError
from gpipe.training import TrainConfig, train
from gpipe.training.config import config_text, read_config_file
from gpipe.training.run import resolve


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser()
    add_parser(top.add_subparsers())
    return top


def _one_line(capsys, *argv: str) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gpipe: error: "), err
    return err.removeprefix("gpipe: error: ")


def test_every_flag_is_a_field_with_the_same_default():
    """Each flag of ``gpipe train --help`` (but --config and --print-config) is the field of
    its name, of its type, and vice versa; a flag left out is the field's default, and the
    default its help states is the one the run resolves to."""
    (train_parser,) = _parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
    actions = {a.dest: a for a in train_parser._actions if a.dest not in ("help",)}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert set(actions) - set(fields) == {"config", "print_config"}
    assert set(fields) - set(actions) == set()
    resolved = resolve(TrainConfig()).config
    for name, field in fields.items():
        action = actions[name]
        if isinstance(action, argparse._StoreTrueAction):
            assert field.default is False and field.type == "bool", name
            continue
        assert action.default is None, name  # not given: the field's default
        kind = {int: "int", float: "float", None: "str"}[action.type]
        assert field.type in (f"{kind} | None", kind), name
        stated = re.search(r"\(default:? ([\w.-]+)[);]", action.help or "")
        if stated and getattr(resolved, name) is not None:
            assert str(getattr(resolved, name)) == str((action.type or str)(stated.group(1))), name


def test_a_flag_given_wins_over_the_file_even_at_its_default(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('out = "elsewhere"\nsteps = 7\nbatch-size = 4\n')
    args = _parser().parse_args(["train", "--config", str(file), "--out", "runs/gpt"])
    config = config_of(args)
    assert (config.out, config.steps, config.batch_size) == ("runs/gpt", 7, 4)
    args = _parser().parse_args(["train", "--config", str(file), "--steps", "9"])
    assert (config_of(args).out, config_of(args).steps) == ("elsewhere", 9)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"steps": 3}\n', r"^--config \S+ is not TOML \(.*\); expected lines such as"),
        ("steps: 3\n", r"^--config \S+ is not TOML"),
        ('steps = "ten"\n', r"^--config \S+: steps must be an integer, got 'ten'$"),
        ("batch_size = 2.5\n", r"^--config \S+: batch_size must be an integer, got 2.5$"),
        ('quiet = "yes"\n', r"^--config \S+: quiet must be true or false, got 'yes'$"),
        ("stepz = 3\n", r"^--config \S+: unknown key 'stepz' \(did you mean steps\?\)"),
        (
            "batch-size = 8\nbatch_size = 9\n",
            r"^--config \S+: 'batch-size' and 'batch_size' are the same key, given twice",
        ),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, text, message):
    file = tmp_path / "run.toml"
    file.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_config_file(file)


def test_a_config_path_that_is_no_file_is_one_line(tmp_path, capsys):
    err = _one_line(capsys, "--config", str(tmp_path / "absent.toml"), "--print-config")
    assert err == f"--config {tmp_path / 'absent.toml'}: no such file; expected a TOML file"
    err = _one_line(capsys, "--config", str(tmp_path), "--print-config")
    assert err == f"--config {tmp_path} is a folder; expected a TOML file"


def test_missing_keys_are_the_defaults(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text("steps = 3\n")
    assert read_config_file(file) == TrainConfig(steps=3)


def test_print_config_keeps_what_was_given_even_empty(tmp_path):
    """An empty ``--prompt`` samples from nothing; the printed configuration (and run.json)
    must say so, or the file read back runs with the default prompt."""
    printed = resolve(TrainConfig(prompt="", preset="tiny")).config
    assert printed.prompt == "" and printed.split_at is None
    file = tmp_path / "run.toml"
    file.write_text(config_text(printed))
    assert read_config_file(file).prompt == ""
    assert resolve(read_config_file(file)).config == printed


def test_print_config_writes_any_text_as_toml_reads_it_back(tmp_path):
    """A prompt or path beyond U+FFFF (an emoji), with quotes, a tab, a newline or a DEL:
    JSON's escapes for some of them are not TOML's, so the file would not read back."""
    odd = 'def 😀 "q" \\ \n\t\x7f é'
    config = TrainConfig(prompt=odd, out=str(tmp_path / "rüns 𝄞"))
    file = tmp_path / "run.toml"
    file.write_text(config_text(config), encoding="utf-8")
    assert read_config_file(file) == config


def test_flag_errors_are_not_prefixed_with_the_class(capsys):
    err = _one_line(capsys, "--report-to", "", "--print-config")
    assert err.startswith("--report-to must be none or a comma-separated list"), err


@pytest.mark.parametrize(
    "given, message",
    [
        ({"steps": 0}, "--steps must be a positive integer, got 0"),
        ({"batch_size": -1}, "--batch-size must be a positive integer, got -1"),
        (
            {"chunks": 64, "batch_size": 8},
            "--chunks 64 is more than each replica's 8 rows of --batch-size 8: give --chunks 8 "
            "or fewer, or a larger --batch-size",
        ),
        (
            {"chunks": 2, "batch_size": 1, "stages": 1},
            "--chunks 2 is more than each replica's 1 row of --batch-size 1: give --chunks 1 ",
        ),
        (
            {"schedule": "nope"},
            "--schedule must be auto or one of gpipe, 1f1b, zero-bubble, interleaved, ",
        ),
        ({"checkpoint": "sometimes"}, "--checkpoint must be always, except_last or never, got "),
        (  # it would overflow the seeds derived from it inside every process
            {"seed": 10**14},
            "--seed must be an integer from -1099511627776 to 1099511627775 (2**40 - 1), got "
            "100000000000000",
        ),
        ({"out": "{file}"}, "--out {file} is a file; expected a run folder (a directory)"),
        ({"out": ""}, "--out must name a run folder, got ''"),
        (  # the run would go on in {file}, not where --out says
            {"resume": "{file}"},
            "--out {run} with --resume {file}: a resumed run goes on in its own folder; ",
        ),
        (  # a V holds two stages per process: another count would be ignored
            {"schedule": "v-min", "virtual_stages": 3, "chunks": 4},
            "--schedule v-min places two stages per process in a V: --virtual-stages is 2, got 3",
        ),
    ],
)
def test_bad_values_fail_before_any_process_alike_from_python_and_the_command(
    tmp_path, capsys, given, message
):
    """``train(TrainConfig(...))`` raises the one line the command prints, before any
    process starts or anything is written."""
    file = tmp_path / "a-file"
    file.write_text("not a run folder")
    run = tmp_path / "run"
    given = {k: (v.format(file=file) if isinstance(v, str) else v) for k, v in given.items()}
    message = message.format(file=file, run=run)
    config = {"preset": "tiny", "seq_len": 16, "out": str(run), **given}
    with pytest.raises(ConfigError) as raised:
        train(TrainConfig(**config))
    assert str(raised.value).startswith(message), raised.value
    assert not (tmp_path / "run").exists()
    flags = [a for k, v in config.items() for a in ("--" + k.replace("_", "-"), str(v))]
    assert _one_line(capsys, *flags).startswith(message)


def test_config_is_a_plain_dataclass():
    import gpipe.training

    assert "TrainConfig" in gpipe.training.__all__
    config = TrainConfig(steps=5, preset="tiny")
    assert dataclasses.replace(config, steps=6) == TrainConfig(steps=6, preset="tiny")
    assert dataclasses.replace(config, steps=5) == config and config != TrainConfig()
    with pytest.raises(ConfigError, match=r"--device must be one of cpu, cuda, got 'tpu'"):
        dataclasses.replace(config, device="tpu")


def test_a_field_set_after_construction_is_checked_when_run(tmp_path):
    """A dataclass's fields can be set after it is made: ``train`` checks them again, so a
    wrong type is the same one line, not a TypeError from deep inside the run."""
    config = TrainConfig(preset="tiny", out=str(tmp_path / "run"))
    config.steps = "ten"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"^TrainConfig.steps is 'ten' \(str\), expected int"):
        train(config)
    config.steps, config.device = 5, "tpu"
    with pytest.raises(ConfigError, match=r"^--device must be one of cpu, cuda, got 'tpu'$"):
        resolve(config)
    assert not (tmp_path / "run").exists()


def test_train_takes_a_train_config_made_by_keyword():
    with pytest.raises(TypeError, match=r"^config must be a gpipe.training.TrainConfig, got dict"):
        train({"steps": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # fifty fields: by position, one moved would shift them all
        TrainConfig("gpt")  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"^TrainConfig.steps is '3' \(str\), expected int"):
        TrainConfig.from_dict({"steps": "3"})  # named once, not "TrainConfig: TrainConfig..."


def test_a_preset_or_another_model_given_with_config_replaces_the_files_model(tmp_path, capsys):
    """``--print-config`` writes the model's shape (n-layer = 2, ...); ``--config`` of that
    file with ``--preset small`` trains the small preset (the file's shape overrode it), and
    with another ``--model`` is not refused for GPT flags the command line never gave."""
    file = tmp_path / "run.toml"
    file.write_text(config_text(resolve(TrainConfig(preset="tiny")).config))
    args = _parser().parse_args(["train", "--config", str(file), "--preset", "small"])
    assert resolve(config_of(args)).config == resolve(TrainConfig(preset="small")).config
    args = _parser().parse_args(["train", "--config", str(file), "--n-layer", "3"])
    assert (config_of(args).n_layer, config_of(args).d_model) == (3, 32)  # the file's model
    absent = tmp_path / "absent"
    err = _one_line(capsys, "--config", str(file), "--model", f"hf:{absent}", "--print-config")
    assert err == f"--model hf:{absent}: no config.json there"


def test_train_called_again_by_the_processes_it_starts_is_refused(tmp_path, monkeypatch):
    """Each started process imports the caller's script again, as ``__mp_main__``: a call
    to ``train`` outside ``if __name__ == "__main__":`` runs again there, and must stop at
    once, not prepare (with ``force``, remove) the folder of the run that started it."""
    import gpipe.training.launch

    def launch(*args, **kwargs):
        raise AssertionError("not to be reached")

    monkeypatch.setattr(gpipe.training.launch, "launch", launch)
    (tmp_path / "metrics.jsonl").write_text("the running job's\n")
    script = "train(TrainConfig(preset='tiny', out=OUT, force=True))\n"
    scope = {"__name__": "__mp_main__", "train": train, "TrainConfig": TrainConfig}
    with pytest.raises(RuntimeError, match=r'call train under if __name__ == "__main__":$'):
        exec(compile(script, "script.py", "exec"), {**scope, "OUT": str(tmp_path)})
    assert (tmp_path / "metrics.jsonl").exists()


def test_resume_with_force_is_refused_and_replaces_a_files_out(tmp_path, capsys):
    """``--force`` (replace the folder) beside ``--resume`` (continue it) would be ignored:
    refused. A ``--resume`` given with ``--config`` goes on in its folder, not the file's."""
    err = _one_line(capsys, "--resume", str(tmp_path), "--force", "--print-config")
    assert (
        err
        == f"--force replaces the run folder and --resume {tmp_path} continues it: give one of them"
    )
    file = tmp_path / "run.toml"
    file.write_text('out = "runs/elsewhere"\nsteps = 7\n')
    args = _parser().parse_args(["train", "--config", str(file), "--resume", str(tmp_path)])
    assert (config_of(args).out, config_of(args).resume, config_of(args).steps) == (
        "runs/gpt",
        str(tmp_path),
        7,
    )
