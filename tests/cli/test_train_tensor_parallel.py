"""`gpipe train --tensor-parallel T`: each stage's layers split over T ranks train the tiny GPT
to the losses of the unsplit pipeline (float32 rounding apart), its checkpoint resumes at
other T and D with the losses the run went on with, and a T the model cannot be split by is
refused in one line before any process starts."""

import contextlib
import io
import json
import shutil

import pytest
import torch

from gpipe.cli import main
from gpipe.errors import ConfigError
from gpipe.training.config import TrainConfig
from gpipe.training.options import TrainOptions
from gpipe.training.run import shape_from_world

from ..workers import training_on_shared_processes

TINY = [
    "--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--chunks", "4",
    "--lr", "1e-2", "--warmup", "2", "--eval-every", "2", "--sample-tokens", "8", "--quiet",
    "--balance", "even", "--stages", "2", "--steps", "4", "--save-every", "2",
    "--threads", "1", "--timeout", "30",
]  # fmt: skip

pytestmark = pytest.mark.usefixtures("train_on_shared_processes")


def _losses(run) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _same_losses(got: dict[int, float], expected: dict[int, float]) -> None:
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 steps at T = 1 and T = 2 (2 stages), a checkpoint every 2; what each
    command printed. (A resumed run's second step is the first whose loss shows the restored
    optimizer state, so 2 steps before the checkpoint and 2 after it are all it takes.)"""
    found = {}
    for t in (1, 2):
        out = tmp_path_factory.mktemp(f"t{t}") / "run"
        printed = io.StringIO()
        with training_on_shared_processes(), contextlib.redirect_stdout(printed):
            code = main(["train", *TINY, "--tensor-parallel", str(t), "--out", str(out)])
        assert code == 0
        found[t] = (out, printed.getvalue())
    return found


def test_two_tensor_ranks_train_as_one_and_the_log_names_the_layout(runs):
    (one, printed_one), (two, printed_two) = runs[1], runs[2]
    _same_losses(_losses(two), _losses(one))
    assert "4 processes: 2 stages x 1 replica x 2 tensor ranks" in printed_two
    assert "2 processes: 2 stages x 1 replica x 1 tensor rank" in printed_one
    description = json.loads((two / "checkpoints" / "step-000002" / "gpipe.json").read_text())
    assert description["tensor_parallel"] == 2 and description["train"]["tensor_parallel"] == 2


@pytest.mark.parametrize(("tensor", "replicas"), [(1, 1), (2, 2)])
def test_a_checkpoint_of_two_tensor_ranks_resumes_at_other_shapes(runs, tmp_path, tensor, replicas):
    """The step-2 checkpoint of the T = 2 run, resumed at T = 1 (the shards gathered) and at
    T = 2 x D = 2: steps 3-4 have the losses of the run never stopped, optimizer included."""
    run = tmp_path / "run"
    shutil.copytree(runs[2][0], run)
    shutil.rmtree(run / "checkpoints" / "step-000004")
    code = main(["train", "--resume", str(run), "--tensor-parallel", str(tensor),
                 "--data-parallel", str(replicas), "--quiet"])  # fmt: skip
    assert code == 0
    _same_losses(_losses(run), _losses(runs[2][0]))


def test_sample_reads_a_tensor_parallel_run_in_one_process(runs, capsys):
    assert main(["sample", str(runs[2][0]), "--prompt", "def ", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def _refused(capsys, *argv) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_tensor_parallel_the_model_cannot_take_is_refused_in_one_line(capsys, tmp_path):
    out = ["--out", str(tmp_path / "new")]
    assert "--tensor-parallel must be a positive integer, got 0" in _refused(
        capsys, "--tensor-parallel", "0", *out
    )
    assert "does not divide the 2 heads of 1.attn.q" in _refused(
        capsys, "--preset", "tiny", "--tensor-parallel", "4", *out
    )
    assert "does not divide the 30 output features of 1.mlp.fc" in _refused(
        capsys, "--preset", "tiny", "--n-head", "4", "--d-ff", "30", "--tensor-parallel", "4", *out
    )
    assert "a helper process cannot write the split (DTensor) state" in _refused(
        capsys, "--preset", "tiny", "--tensor-parallel", "2", "--save-writer", "process", *out
    )
    assert not (tmp_path / "new").exists()


def test_under_torchrun_the_tensor_ranks_stay_and_the_pipelines_share_the_rest():
    opts = TrainOptions(tensor_parallel=2)
    shape_from_world(TrainConfig(stages=2), opts, 8)
    assert (opts.stages, opts.data_parallel, opts.tensor_parallel) == (2, 2, 2)
    with pytest.raises(ConfigError, match="--tensor-parallel 2, but torchrun started 7"):
        shape_from_world(TrainConfig(), TrainOptions(tensor_parallel=2), 7)
    with pytest.raises(ConfigError, match=r"started 12 processes \(6 per tensor rank"):
        shape_from_world(TrainConfig(stages=4), TrainOptions(tensor_parallel=2), 12)


def test_a_hugging_face_model_trains_by_its_own_tensor_plan_resumes_and_exports(tmp_path):
    """A Qwen3-MoE config at T = 2 (attention split by heads, the stacked experts' packed
    gate-and-up maps side by side): its starting weights read into the split parameters, the
    losses of T = 1; its step-3 checkpoint resumed at T = 1 goes on with the same losses,
    optimizer included; and the run exported as a folder ``from_pretrained`` loads, with the
    weights of the run at T = 1."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    config.save_pretrained(tmp_path / "moe")
    args = [
        "--model", f"hf:{tmp_path / 'moe' / 'config.json'}", "--stages", "2", "--steps", "4",
        "--save-every", "2", "--seq-len", "16", "--batch-size", "4", "--chunks", "2",
        "--sample-tokens", "0", "--threads", "1", "--quiet",
    ]  # fmt: skip
    losses = {}
    for t in (1, 2):
        out = tmp_path / f"t{t}"
        with training_on_shared_processes():
            assert main(["train", *args, "--tensor-parallel", str(t), "--out", str(out)]) == 0
        losses[t] = _losses(out)
    _same_losses(losses[2], losses[1])
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "t2", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    with training_on_shared_processes():
        assert main(["train", "--resume", str(resumed), "--tensor-parallel", "1", "--quiet"]) == 0
    _same_losses(_losses(resumed), losses[2])
    exported = {}
    for t in (1, 2):
        assert main(["export", str(tmp_path / f"t{t}"), "--hf", str(tmp_path / f"e{t}")]) == 0
        exported[t] = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"e{t}")
    assert exported[2].config.num_experts == 4
    whole = exported[1].state_dict()
    for name, weight in exported[2].state_dict().items():
        torch.testing.assert_close(weight, whole[name], rtol=1e-4, atol=1e-5, msg=name)
