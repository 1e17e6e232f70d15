"""`gpipe train` and `gpipe sample`: a tiny model trains in 1 and 2 processes, a resumed run
continues exactly, and bad input ends in one line and exit code 2."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy
import pytest
import torch

from gpipe.cli import main
from gpipe.models import PRESETS, GPTConfig, build_gpt
from gpipe.planning.balancing import balance_by_params
from gpipe.schedules import SCHEDULES
from gpipe.training.balance_choice import held_choice
from gpipe.training.checkpoints.format import load_model_weights
from gpipe.training.options import TrainOptions

from ..workers import training_on_shared_processes

TINY = [
    "--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--chunks", "4",
    "--lr", "1e-2", "--warmup", "2", "--eval-every", "5", "--sample-tokens", "16", "--quiet",
]  # fmt: skip


pytestmark = pytest.mark.usefixtures("train_on_shared_processes")


def _losses(run) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _description(run, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step-{step:06d}" / "gpipe.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two tiny runs, 1 and 2 stages, 20 steps with a checkpoint every 10; the first also
    reports to TensorBoard and W&B (offline: tests/conftest.py)."""
    runs = {}
    for stages in (1, 2):
        out = tmp_path_factory.mktemp(f"run{stages}")
        report = ["--report-to", "tensorboard,wandb"] if stages == 1 else []
        with training_on_shared_processes():
            code = main(["train", *TINY, "--stages", str(stages), "--steps", "20", *report,
                         "--save-every", "10", "--out", str(out), "--force"])  # fmt: skip
        assert code == 0
        runs[stages] = out
    return runs


@pytest.mark.parametrize("stages", [1, 2])
def test_loss_falls(trained, stages):
    losses = _losses(trained[stages])
    assert sorted(losses) == list(range(1, 21))
    first = sum(losses[s] for s in (1, 2, 3)) / 3
    last = sum(losses[s] for s in (18, 19, 20)) / 3
    assert first > 5.0
    assert last < first - 1.0


@pytest.mark.parametrize("stages", [1, 2])
def test_run_folder_holds_checkpoints_metrics_and_sample(trained, stages):
    run = trained[stages]
    assert (run / "run.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000010",
        "step-000020",
    ]
    description = _description(run, 20)
    assert description["step"] == 20 and description["stages"] == stages
    assert len(description["balance"]) == stages and sum(description["balance"]) == 4
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "bubble"} <= record.keys()
    assert 0 <= record["bubble"] < 1
    assert len((run / "sample.txt").read_bytes()) > 0


def _metrics(run) -> dict[int, dict[str, float]]:
    """metrics.jsonl's records by step, without the step."""
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r.pop("step"): r for r in records}


def _tensorboard_scalars(folder) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    logged: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            logged.setdefault(event.step, {})[tag] = event.value
    return logged


def _wandb_history(run_file) -> dict[int, dict[str, float]]:
    """The history rows of an offline W&B run's ``.wandb`` file: LevelDB's log format (32 KiB
    blocks of records, each a 7-byte header and a piece of a protobuf ``Record``), after
    W&B's own 7-byte header."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    logged: dict[int, dict[str, float]] = {}
    position, pieces = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        length, kind = (
            int.from_bytes(data[position + 4 : position + 6], "little"),
            data[position + 6],
        )
        if left < 7 or kind == 0:  # a block's padding
            position += left
            continue
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = Record.FromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item  # a key in key, or in nested_key as a path
                row = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items}
                logged[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return logged


def test_report_to_logs_the_metrics_of_metrics_jsonl(trained):
    """--report-to tensorboard,wandb: every record of metrics.jsonl, key for key at its step,
    in the run folder's tensorboard/ (as float32 scalars) and its offline W&B run."""
    run = trained[1]
    metrics = _metrics(run)
    assert _tensorboard_scalars(run / "tensorboard") == {
        step: {key: float(numpy.float32(value)) for key, value in record.items()}
        for step, record in metrics.items()
    }
    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    assert _wandb_history(run_file) == metrics
    assert json.loads((run / "run.json").read_text())["train"]["report_to"] == "tensorboard,wandb"


def test_two_stages_train_as_one(trained):
    """Same data, same micro-batches: the pipeline changes only the rounding."""
    one, two = _losses(trained[1]), _losses(trained[2])
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step


def test_tied_copies_stay_equal_across_stages(trained):
    model = build_gpt(
        GPTConfig.from_dict(json.loads((trained[2] / "run.json").read_text())["model"])
    )
    load_model_weights(trained[2] / "checkpoints" / "step-000020", model)
    assert torch.equal(model[0].token.weight, model[-1].proj.weight)
    assert not torch.equal(model[0].token.weight, build_gpt(PRESETS["tiny"])[0].token.weight)


def test_train_from_python_is_the_command(trained, tmp_path):
    """``train(TrainConfig(...))`` runs what ``gpipe train`` with the same flags runs: the
    same losses, step for step, and the summary returned."""
    from gpipe.errors import ConfigError
    from gpipe.training import TrainConfig, train
    from gpipe.training.config import config_text, read_config_file

    flags = dict(zip(TINY[:-1:2], TINY[1::2], strict=False))
    config = TrainConfig.from_dict({k[2:]: _typed(v) for k, v in flags.items()})
    config = TrainConfig(**config.given(), quiet=True, stages=1, steps=20, save_every=10)
    config.out = str(tmp_path / "run")
    summary = train(config)
    assert summary is not None and summary["steps"] == 20
    assert _losses(tmp_path / "run") == _losses(trained[1])
    file = tmp_path / "run.toml"
    file.write_text(config_text(config))
    assert read_config_file(file) == config
    with pytest.raises(ConfigError, match="TrainConfig.steps is 'ten' \\(str\\), expected int"):
        TrainConfig(steps="ten")
    with pytest.raises(ConfigError, match="--device must be one of cpu, cuda, got 'tpu'"):
        TrainConfig(device="tpu")


def test_print_config_then_config_is_the_same_run(trained, tmp_path, capsys):
    """``--print-config``'s file, read back by ``--config`` (with --out given on top, which
    wins), runs the same losses as the flags it was printed from."""
    flags = [*TINY, "--stages", "2", "--steps", "20", "--save-every", "10"]
    assert main(["train", *flags, "--print-config"]) == 0
    file = tmp_path / "run.toml"
    file.write_text(capsys.readouterr().out)
    out = tmp_path / "run"
    with training_on_shared_processes():
        assert main(["train", "--config", str(file), "--out", str(out)]) == 0
    again, first = _losses(out), _losses(trained[2])
    assert again.keys() == first.keys()
    for step in first:
        assert again[step] == pytest.approx(first[step], rel=1e-4), step


def _typed(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def test_resume_continues_exactly(trained, tmp_path):
    """A run stopped after its step-10 checkpoint, resumed, repeats steps 11-20 exactly."""
    run = tmp_path / "run"
    shutil.copytree(trained[2], run)
    shutil.rmtree(run / "checkpoints" / "step-000020")
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(metrics[:10]) + "\n")
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert _losses(run) == _losses(trained[2])
    assert _description(run, 20)["balance"] == _description(trained[2], 10)["balance"]


def test_a_checkpoint_of_two_stages_resumes_with_one(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained[2], run)
    assert main(["train", "--resume", str(run), "--stages", "1", "--steps", "22"]) == 0
    losses = _losses(run)
    assert set(losses) == set(range(1, 23))
    assert abs(losses[21] - losses[20]) < 0.5


def test_sample_reads_a_run_or_a_checkpoint(trained, capsys):
    run = trained[2]
    assert main(["sample", str(run), "--prompt", "import ", "--tokens", "20"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("import ")
    assert main(["sample", str(run / "checkpoints" / "step-000010"), "--tokens", "5"]) == 0


def test_help_says_train_a_model(capsys):
    """Not only the GPT: --model takes a Hugging Face model or your own."""
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    assert re.search(r"^\s+train\s+train a model, pipelined", capsys.readouterr().out, re.M)


def _usage_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("gpipe: error: ")
    return err


def test_bad_options_end_in_one_line_and_exit_code_2(capsys, tmp_path):
    out = ["--out", str(tmp_path / "new")]
    assert "unrecognized arguments: --fast" in _usage_error(capsys, "train", "--fast")
    assert "--stages 9 is more than the model's 4 layers" in _usage_error(
        capsys, "train", "--preset", "tiny", "--stages", "9", *out
    )
    assert "--chunks must be a positive integer, got 0" in _usage_error(
        capsys, "train", "--chunks", "0", *out
    )
    for flags, message in (
        (["--virtual-stages", "2"], "--schedule auto chooses the stages per process; leave"),
        (["--balance", "even"], "--balance even: --schedule auto chooses the cut by time"),
        (["--chunks", "64"], "--chunks 64 is more than each replica's 32 rows of --batch-size"),
    ):
        assert message in _usage_error(capsys, "train", "--schedule", "auto", *flags, *out)
    assert "--schedule dualpipe-v needs --chunks of at least 4 for --stages 2, got 2" in (
        _usage_error(capsys, "train", "--schedule", "dualpipe-v", "--chunks", "2", *out)
    )
    assert "--schedule v-min needs --chunks of at least 2 for --stages 2, got 1" in (
        _usage_error(capsys, "train", "--schedule", "v-min", "--chunks", "1", *out)
    )
    assert (
        "--schedule v-min runs at least 2 micro-batches for --stages 2: each replica's share of "
        "--batch-size must be at least 2 rows, got 1 (--batch-size 1 over 1 replica(s))"
    ) in _usage_error(
        capsys, "train", "--schedule", "v-min", "--chunks", "2", "--batch-size", "1", *out
    )
    assert "--seq-len 64 is above the model's maximum of 32" in _usage_error(
        capsys, "train", "--preset", "tiny", "--seq-len", "64", *out
    )
    # the model's shape refused in the flags' names, not GPTConfig's fields
    assert "--dropout must be in [0, 1), got 1.0" in _usage_error(
        capsys, "train", "--dropout", "1", *out
    )
    assert "--d-model must be divisible by --n-head, got --d-model=128, --n-head=3" in (
        _usage_error(capsys, "train", "--n-head", "3", *out)
    )
    assert "--checkpoint must be always, except_last or never, got 'sometimes'" in _usage_error(
        capsys, "train", "--checkpoint", "sometimes", *out
    )
    assert "unknown preset 'huge'" in _usage_error(capsys, "train", "--preset", "huge", *out)
    assert "--threads must be a positive integer, got 0" in _usage_error(
        capsys, "train", "--threads", "0", *out
    )
    assert "--virtual-stages 2 needs --schedule interleaved" in _usage_error(
        capsys, "train", "--virtual-stages", "2", *out
    )
    assert "needs --chunks a multiple of --stages (2)" in _usage_error(
        capsys, "train", "--schedule", "interleaved", "--chunks", "3", *out
    )
    assert (
        "--balance must be time, params, even, or 2 positive layer counts that add up to the "
        "model's 4 layers (such as 2,2), got '1,2'"
    ) in _usage_error(capsys, "train", "--preset", "tiny", "--balance", "1,2", *out)
    assert "--data-parallel must be a positive integer, got 0" in _usage_error(
        capsys, "train", "--data-parallel", "0", *out
    )
    assert "--batch-size 3 cannot give each of --data-parallel 4 replicas a row" in _usage_error(
        capsys, "train", "--data-parallel", "4", "--batch-size", "3", "--chunks", "1", *out
    )
    assert "invalid choice: 'fp8'" in _usage_error(capsys, "train", "--precision", "fp8", *out)
    assert "--keep must be at least 1 (the newest good checkpoint), got 0" in _usage_error(
        capsys, "train", "--keep", "0", *out
    )
    for flags, message in (
        (["--keep-every", "-1"], "--keep-every must not be negative, got -1"),
        (["--warmup", "-2"], "--warmup must not be negative, got -2"),
        (["--sample-tokens", "-1"], "--sample-tokens must not be negative, got -1"),
        (["--lr", "-1"], "--lr must be a finite number, 0 or more, got -1.0"),
        (["--lr", "nan"], "--lr must be a finite number, 0 or more, got nan"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    ):
        assert message in _usage_error(capsys, "train", *flags, *out)
    assert "--save-writer process (given, or the run's own) says what writes" in _usage_error(
        capsys, "train", "--save-writer", "process", "--sync-save", *out
    )
    assert not (tmp_path / "new").exists()


def test_report_to_is_refused_before_any_process_starts(capsys, tmp_path, monkeypatch):
    """An unknown tracker, or one whose package is not installed, is one line naming the
    flag (and the extra that installs the package)."""
    out = ["--out", str(tmp_path / "new")]
    assert (
        "--report-to must be none or a comma-separated list of tensorboard, wandb, got "
        "'tensorboard,mlflow'"
    ) in _usage_error(capsys, "train", "--report-to", "tensorboard,mlflow", *out)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    assert "--report-to wandb needs the wandb package: pip install 'gpipe-parallel[wandb]'" in (
        _usage_error(capsys, "train", "--report-to", "wandb", *out)
    )
    assert not (tmp_path / "new").exists()


def test_data_without_readable_text_is_refused(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(bytes(range(256)) * 4)
    err = _usage_error(capsys, "train", "--data", str(empty), "--out", str(tmp_path / "r"))
    assert str(empty) in err


def test_a_run_folder_is_not_overwritten_without_force(capsys, trained):
    run = trained[1]
    before = (run / "metrics.jsonl").read_text()
    err = _usage_error(capsys, "train", "--preset", "tiny", "--out", str(run))
    assert "is not empty; pass --force" in err
    assert (run / "metrics.jsonl").read_text() == before


def test_a_resumed_runs_printed_config_names_its_own_folder(capsys, trained):
    assert main(["train", "--resume", str(trained[1]), "--print-config"]) == 0
    assert f"out = {json.dumps(str(trained[1]))}" in capsys.readouterr().out.splitlines()


def test_a_run_on_balanced_sub_sequences_resumes_with_whole_micro_batches(
    capsys, trained, tmp_path
):
    """--seq-chunks 1 alone: the run's own --seq-split balanced, of sub-sequences no longer
    cut, is not held against it ("needs --seq-chunks of 2 or more")."""
    run = tmp_path / "run"
    shutil.copytree(trained[2], run)
    record = json.loads((run / "run.json").read_text())
    record["train"] |= {"seq_chunks": 4, "seq_split": "balanced"}
    (run / "run.json").write_text(json.dumps(record))
    assert main(["train", "--resume", str(run), "--seq-chunks", "1", "--print-config"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "seq-chunks = 1" in printed and 'seq-split = "even"' in printed
    err = _usage_error(capsys, "train", *TINY, "--seq-split", "balanced", "--print-config")
    assert err == "gpipe: error: --seq-split balanced needs --seq-chunks of 2 or more"


def test_resume_refuses_a_different_model(capsys, trained, tmp_path):
    err = _usage_error(capsys, "train", "--resume", str(trained[1]), "--n-layer", "3")
    assert "holds a model with n_layer=2, not n_layer=3" in err
    err = _usage_error(capsys, "train", "--resume", str(tmp_path))
    assert "no gpipe run with a complete checkpoint there" in err
    err = _usage_error(capsys, "sample", str(tmp_path))
    assert "no gpipe checkpoint there" in err


def test_under_torchrun_the_stages_are_torchruns_processes(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "gpipe.cli", "train", *TINY, "--steps", "3", "--out", str(out),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"stages \[[1-3], [1-3]\]", done.stdout)  # measured: any 2-way cut
    assert sorted(_losses(out)) == [1, 2, 3]
    assert json.loads((out / "run.json").read_text())["train"]["stages"] == 2


@pytest.mark.parametrize(
    ("schedule", "more", "balance"),
    [
        ("1f1b", ["--balance", "1,3"], [1, 3]),  # a balance given
        ("zero-bubble", ["--balance", "params"], "params"),  # or counted
        ("interleaved", ["--virtual-stages", "2"], None),
    ],
)
def test_every_schedule_trains_and_traces(tmp_path, schedule, more, balance):
    out = tmp_path / "run"
    code = main(["train", *TINY, "--steps", "3", "--schedule", schedule, *more, "--trace",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    if balance == "params":
        balance = balance_by_params(2, build_gpt(PRESETS["tiny"], device="meta"))
    if balance is not None:
        assert _description(out, 3)["balance"] == balance
    trace = json.loads((out / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"F0", "B0"} <= names
    assert ("W0" in names) == (schedule == "zero-bubble")
    assert any(
        e["args"].get("name", "").startswith("predicted")
        for e in trace["traceEvents"]
        if e["ph"] == "M"
    )
    if importlib.util.find_spec("matplotlib"):
        assert (out / "timeline.png").stat().st_size > 0
    page = (out / "view.html").read_text()  # the interactive page, for the same step
    data = json.loads(re.search(r'id="gpipe-data">(.*?)</script>', page, re.S).group(1))
    ranks = {
        e["pid"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["args"].get("name", "").startswith("rank")
    }
    measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] in ranks]
    assert len(data["measured"]["events"]) == len(measured)
    assert data["measured"]["schedule"]["name"] == schedule


def test_train_notes_fewer_than_four_micro_batches_per_stage(capsys, tmp_path):
    """The line `gpipe plan` prints (test_advice), before the run starts."""
    args = ["train", "--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--steps", "1",
            "--eval-every", "1", "--sample-tokens", "0", "--quiet", "--stages", "2",
            "--checkpoint", "never", "--chunks", "4", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    # --sample-tokens 0: no sample at all (it printed "sample:" and the bare prompt)
    assert "sample:" not in out and not (tmp_path / "run" / "sample.txt").exists()
    notes = re.findall(r"^note:.*$", out, re.M)
    assert notes == [
        "note: --chunks 4 is below 4 x --stages 2, the GPipe paper's rule of thumb: gpipe's "
        "predicted bubble is 20.0%; --chunks 10 (and --batch-size 10) would bring it under "
        "10% (9.1%)"
    ]


def test_auto_announces_its_choice_and_a_resumed_run_keeps_it(tmp_path, capfd):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--schedule", "auto", "--out", str(out)]) == 0
    said = capfd.readouterr().err
    assert said.count("schedule auto: ") == 1 and "; runner-up " in said
    saved = json.loads((out / "checkpoints" / "step-000002" / "gpipe.json").read_text())
    chosen = saved["train"]
    assert chosen["schedule"] in SCHEDULES and chosen["chunks"] >= 1
    assert json.loads((out / "run.json").read_text())["train"]["schedule"] == "auto"
    resumed = held_choice(TrainOptions(schedule="auto", chunks=None), saved)
    assert (resumed.schedule, resumed.chunks, resumed.virtual_stages) == (
        chosen["schedule"],
        chosen["chunks"],
        chosen["virtual_stages"],
    )
    assert held_choice(TrainOptions(schedule="1f1b"), saved).schedule == "1f1b"


def test_data_parallel_trains_as_one_pipeline_and_saves_once_per_stage(trained, tmp_path):
    """D = 2 replicas of the 2-stage pipeline, the global --batch-size split between them:
    the same losses as D = 1 (within float rounding); the checkpoint holds one copy."""
    out = tmp_path / "dp"
    code = main(["train", *TINY, "--stages", "2", "--data-parallel", "2", "--steps", "20",
                 "--save-every", "10", "--out", str(out)])  # fmt: skip
    assert code == 0
    one, two = _losses(trained[2]), _losses(out)
    assert sorted(two) == sorted(one)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
    description = _description(out, 20)
    assert description["stages"] == 2 and description["data_parallel"] == 2
    # one copy of the weights: the same files as the single pipeline's checkpoint
    names = {p.name for p in (out / "checkpoints" / "step-000020").iterdir()}
    assert names == {p.name for p in (trained[2] / "checkpoints" / "step-000020").iterdir()}
    # resumed with other D and K: within float tolerance of the single pipeline's run
    assert main(["train", "--resume", str(out), "--stages", "1", "--data-parallel", "1",
                 "--steps", "22", "--quiet"]) == 0  # fmt: skip
    assert set(_losses(out)) == set(range(1, 23))


def test_sharded_replicas_train_as_one_pipeline_and_resume_unsharded(trained, tmp_path, capsys):
    """--shard full over D = 2 replicas of the 2-stage pipeline: the first steps' losses are
    D = 1's (within float rounding); every replica writes its shard, and the checkpoint of
    step 4 resumes unsharded at D = 1 with the losses the sharded run went on with."""
    out = tmp_path / "sharded"
    code = main(["train", *TINY, "--stages", "2", "--data-parallel", "2", "--shard", "full",
                 "--steps", "6", "--save-every", "4", "--out", str(out)])  # fmt: skip
    assert code == 0
    one, sharded = _losses(trained[2]), _losses(out)
    for step in (1, 2, 3):  # before the learning rates of a 20-step and a 6-step run differ
        assert sharded[step] == pytest.approx(one[step], rel=1e-5), step
    assert _description(out, 4)["train"]["shard"] == "full"
    shutil.rmtree(out / "checkpoints" / "step-000006")
    assert main(["train", "--resume", str(out), "--data-parallel", "1", "--shard", "none",
                 "--quiet"]) == 0  # fmt: skip
    resumed = _losses(out)
    for step in (5, 6):
        assert resumed[step] == pytest.approx(sharded[step], rel=1e-5), step
    assert "needs data_parallel > 1" in _usage_error(capsys, "train", "--shard", "full")


@pytest.fixture(scope="module")
def eager_1f1b(tmp_path_factory):
    """The losses of 4 steps on 2 stages under 1F1B, eager, of whole micro-batches: what the
    compiled layers and the sub-sequences of the tests below train to (one run for both;
    --seq-chunks 1 is the default, given as the run of sub-sequences is compared with it)."""
    out = tmp_path_factory.mktemp("eager-1f1b")
    with training_on_shared_processes():
        code = main(["train", *TINY, "--stages", "2", "--steps", "4", "--schedule", "1f1b",
                     "--seq-chunks", "1", "--out", str(out)])  # fmt: skip
    assert code == 0
    return _losses(out)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_compiled_layers_train_as_eager_ones(tmp_path, schedule, eager_1f1b):
    """--compile: the losses of the eager run, within float32 rounding (the graphs of
    AOTAutograd without generated code: the default backend's compile time is for
    BENCHMARKS.md)."""
    runs = {False: eager_1f1b} if schedule == "1f1b" else {}
    for compiled in (False, True):
        if compiled in runs:
            continue
        out = tmp_path / f"{schedule}-{compiled}"
        more = ["--compile", "--compile-backend", "aot_eager"] if compiled else []
        code = main(["train", *TINY, "--stages", "2", "--steps", "4", "--schedule", schedule,
                     *more, "--out", str(out)])  # fmt: skip
        assert code == 0
        runs[compiled] = _losses(out)
    assert runs[True].keys() == runs[False].keys() == {1, 2, 3, 4}
    for step, loss in runs[False].items():
        assert runs[True][step] == pytest.approx(loss, rel=1e-5), step
    train = json.loads((tmp_path / f"{schedule}-True" / "run.json").read_text())["train"]
    assert train["compile"] and train["compile_backend"] == "aot_eager"


def test_compile_is_refused_where_it_is_not_supported(capsys):
    assert "--compile is not supported with --tensor-parallel or --shard yet" in _usage_error(
        capsys, "train", "--compile", "--tensor-parallel", "2"
    )
    assert "--compile-backend aot_eager needs --compile" in _usage_error(
        capsys, "train", "--compile-backend", "aot_eager"
    )
    assert "--compile-backend nope: compile's backend 'nope' is not one" in _usage_error(
        capsys, "train", "--compile", "--compile-backend", "nope"
    )


def test_sub_sequences_train_to_the_losses_of_whole_micro_batches(tmp_path, eager_1f1b):
    """--seq-chunks 4: each micro-batch as four sub-sequences through 1F1B, and through
    zero-bubble-v's V with compiled layers; the losses of the run of whole micro-batches
    (--seq-chunks 1), within float32 rounding."""
    runs = {"1": eager_1f1b}
    one_f_one_b = ["--schedule", "1f1b"]
    v = ["--schedule", "zero-bubble-v", "--compile", "--compile-backend", "aot_eager"]
    for name, chunks, more in (("4", 4, one_f_one_b), ("4-v", 4, v)):
        out = tmp_path / f"seq-{name}"
        code = main(["train", *TINY, "--stages", "2", "--steps", "4", "--seq-chunks",
                     str(chunks), *more, "--out", str(out)])  # fmt: skip
        assert code == 0
        runs[name] = _losses(out)
    assert runs["4"].keys() == runs["4-v"].keys() == runs["1"].keys() == {1, 2, 3, 4}
    for step, loss in runs["1"].items():
        assert runs["4"][step] == pytest.approx(loss, rel=1e-5), step
        assert runs["4-v"][step] == pytest.approx(loss, rel=1e-5), step
    train = json.loads((tmp_path / "seq-4" / "run.json").read_text())["train"]
    assert train["seq_chunks"] == 4 and train["seq_split"] == "even"


def test_sub_sequences_are_refused_where_they_cannot_run(capsys):
    base = ["train", "--preset", "tiny", "--seq-len", "32"]
    for more, words in (
        (["--seq-chunks", "3"], "--seq-chunks 3 does not divide --seq-len 32: give a multiple"),
        (["--seq-chunks", "48"], "--seq-chunks 48 is more than --seq-len 32 tokens"),
        (["--seq-chunks", "2", "--schedule", "interleaved"], "--seq-chunks 2 runs with --schedule"),
        (["--seq-chunks", "2", "--pack"], "--seq-chunks 2 does not run with --pack yet"),
        (["--seq-split", "balanced"], "--seq-split balanced needs --seq-chunks of 2 or more"),
        (["--seq-chunks", "0"], "--seq-chunks must be a positive integer, got 0"),
    ):
        assert words in _usage_error(capsys, *base, *more), more


def test_sub_sequences_of_a_traced_hugging_face_model_are_refused_before_launch(capsys, tmp_path):
    """A config that declares no pipeline plan is traced, and traced stages keep no keys and
    values: refused in one line before any process starts, not after launch."""
    transformers = pytest.importorskip("transformers", reason="the test extra installs it")
    folder = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256).save_pretrained(folder)
    argv = ["--model", f"hf:{folder}", "--seq-len", "32", "--seq-chunks", "2"]
    message = _usage_error(capsys, "train", *argv, "--out", str(tmp_path / "run"))
    assert "--seq-chunks 2 with --model hf:" in message, message
    assert "gpt2 declares none" in message, message


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, precision):
    out = tmp_path / precision
    code = main(["train", *TINY, "--stages", "2", "--steps", "12", "--precision", precision,
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    losses = _losses(out)
    assert all(loss == loss and loss < 10 for loss in losses.values())  # finite
    assert sum(losses[s] for s in (10, 11, 12)) < sum(losses[s] for s in (1, 2, 3)) - 0.5
    assert json.loads((out / "run.json").read_text())["train"]["precision"] == precision


def test_the_shape_under_torchrun_follows_the_pinned_dimension():
    from gpipe.errors import ConfigError as UsageError
    from gpipe.training.config import TrainConfig
    from gpipe.training.options import TrainOptions
    from gpipe.training.run import shape_from_world as _shape_from_world

    def given(stages=None, data_parallel=None):
        return TrainConfig(stages=stages, data_parallel=data_parallel)

    opts = TrainOptions(data_parallel=2)
    _shape_from_world(given(), opts, 8)
    assert (opts.stages, opts.data_parallel) == (4, 2)  # D kept, K follows
    opts = TrainOptions(data_parallel=2)
    _shape_from_world(given(stages=2), opts, 6)
    assert (opts.stages, opts.data_parallel) == (2, 3)  # K pinned, D follows
    with pytest.raises(UsageError, match="--stages 4, but torchrun started 6 processes"):
        _shape_from_world(given(stages=4), TrainOptions(), 6)
    with pytest.raises(UsageError, match="--data-parallel 4, but torchrun started 6"):
        _shape_from_world(given(), TrainOptions(data_parallel=4), 6)
    with pytest.raises(UsageError, match="--stages 2 x --data-parallel 2 processes, but torchrun"):
        _shape_from_world(given(stages=2, data_parallel=2), TrainOptions(data_parallel=2), 6)
    for flag, value in (("stages", 0), ("data_parallel", -1)):
        with pytest.raises(UsageError, match="must be a positive integer, got"):
            _shape_from_world(given(**{flag: value}), TrainOptions(), 6)


def test_files_that_are_not_utf8_are_named_in_one_line(tmp_path):
    """A --config, --devices or hf: config.json file of other bytes: the flag and the file
    named, not a UnicodeDecodeError's traceback (--prompts: tests/cli/test_generate.py)."""
    from gpipe.errors import ConfigError
    from gpipe.planning.hardware import load_devices
    from gpipe.planning.hf_config import from_hf_config
    from gpipe.training.config import read_config_file

    bad = tmp_path / "latin1"
    bad.write_bytes(b"steps = 10 # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"^--config .*latin1: .*utf-8"):
        read_config_file(bad)
    with pytest.raises(ValueError, match=r"^--devices .*latin1: .*utf-8"):
        load_devices(bad)
    with pytest.raises(ValueError, match=r"^--model hf:.*latin1: cannot read a config\.json"):
        from_hf_config(bad)


@pytest.mark.parametrize(("sig", "status"), [(None, 1), (2, 130), (15, 143)])
def test_a_run_stopped_by_a_signal_exits_as_a_shell_reports_it(monkeypatch, capsys, sig, status):
    """Ctrl-C (SIGINT) or SIGTERM of the launch: 128 + the signal, as a script expects of a
    command a signal stopped; any other failure of the processes, 1."""
    from gpipe import LaunchError

    def stopped(config):
        raise LaunchError("interrupted by SIGINT: stopped the 2 launched processes", signal=sig)

    monkeypatch.setattr("gpipe.training.run.train", stopped)
    assert main(["train", "--steps", "1"]) == status
    assert capsys.readouterr().err.startswith("gpipe: failed: interrupted by SIGINT")
