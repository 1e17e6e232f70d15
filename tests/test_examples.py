"""The examples run as a user would run them, and reach what their docstrings promise. Those
whose processes ``gpipe.launch`` starts and whose output comes from the launching process
run their ``main`` here, on the module's shared processes (``tests/workers.py``): a new
Python and its forkserver would import torch, gpipe and the example's libraries again
(8 to 10 CPU seconds) to prove nothing the launch tests do not."""

import argparse
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .workers import launching_on_shared_processes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _main(example: dict, script: Path, argv: list[str], capsys) -> str:
    """What ``python SCRIPT ARGV`` prints, its ``gpipe.launch`` on the shared processes; the
    number of threads it sets for itself is this process's again afterwards."""
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        with launching_on_shared_processes(str(script)):
            example["main"](argv)
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def test_resnet_digits_trains_pipelined_as_well_as_without_the_pipeline(capsys):
    script = EXAMPLES / "resnet_digits.py"
    out = _main(runpy.run_path(str(script)), script, ["--epochs", "3"], capsys)
    found = dict(
        re.findall(r"^(pipelined|without the pipeline).*?test accuracy ([\d.]+)%", out, re.M)
    )
    assert set(found) == {"pipelined", "without the pipeline"}, out
    piped, plain = float(found["pipelined"]), float(found["without the pipeline"])
    print(out)
    assert piped >= 98.0
    assert abs(piped - plain) <= 1.0


def test_gpt2_finetune_starts_from_given_weights_and_saves_weights_the_unsplit_model_loads(
    tmp_path, capsys
):
    """One run covers both ends: it loads ``--weights`` into its stages (its first validation
    loss is the unsplit model's on those weights) and saves what an unsplit model loads (its
    last validation loss is the unsplit model's on the saved weights)."""
    transformers = pytest.importorskip("transformers", reason="the examples extra installs it")
    script = EXAMPLES / "gpt2_finetune.py"
    example = runpy.run_path(str(script))  # its functions, not its run
    defaults = argparse.Namespace(seq_len=64, batch_size=16, data_bytes=2_000_000, val_batches=4)
    torch.manual_seed(1)  # not the example's own seed: weights it could not have made itself
    start = tmp_path / "start.pt"
    torch.save(
        transformers.GPT2LMHeadModel(example["config"](defaults.seq_len)).state_dict(), start
    )
    out = tmp_path / "gpt2.pt"
    argv = ["--steps", "10", "--weights", str(start), "--out", str(out)]
    printed = _main(example, script, argv, capsys)
    losses = re.search(r"validation loss ([\d.]+) -> ([\d.]+)", printed)
    unsplit = re.search(r"on the saved weights .*: validation loss ([\d.]+)", printed)
    assert losses and unsplit, printed
    before, after = float(losses[1]), float(losses[2])
    assert after < before - 1.0, printed  # from about ln 256 = 5.5
    assert abs(float(unsplit[1]) - after) < 2e-3, printed
    on_the_start = example["unsplit_loss"](argparse.Namespace(**vars(defaults), out=str(start)))
    assert abs(before - on_the_start) < 2e-3, (before, on_the_start)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU cap is Linux's")
def test_a_model_that_does_not_fit_one_capped_process_trains_in_two():
    """examples/memory_cap.py: one process runs out of memory under the cap; two, each under
    the same cap, train with re-materialization to the losses of the uncapped run."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "memory_cap.py"), "--steps", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"^without the pipeline, capped: out of memory in step 1 \(", out, re.M)
    passes = {
        name: [float(x) for x in losses.split()]
        for name, losses in re.findall(
            r"^(pipelined|without the pipeline, uncapped).*?trained 8 steps .*? ([\d. ]+)$",
            out,
            re.M,
        )
    }
    assert set(passes) == {"pipelined", "without the pipeline, uncapped"}, out
    piped, plain = passes["pipelined"], passes["without the pipeline, uncapped"]
    assert piped == pytest.approx(plain, rel=1e-4)
    assert piped[-1] < 0.75 * piped[0]  # it learns: two passes over the mini-batches
    worst = float(re.search(r"largest relative difference ([\d.e+-]+)", out).group(1))
    assert worst < 1e-4


def test_lightning_module_trains_pipelined_to_the_losses_of_one_device():
    """examples/lightning_module.py: Lightning starts the second process itself; the two
    runs' losses agree to float32's rounding, and the spirals are learned."""
    pytest.importorskip("lightning", reason="the lightning extra installs lightning")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_module.py"), "--steps", "100"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {
        name: (float(loss), float(accuracy))
        for name, loss, accuracy in re.findall(
            r"^(pipelined|without the pipeline).*?validation loss ([\d.]+), accuracy ([\d.]+)%",
            done.stdout,
            re.M,
        )
    }
    print(done.stdout)
    assert set(runs) == {"pipelined", "without the pipeline"}, done.stdout
    (loss, accuracy), (plain_loss, plain_accuracy) = runs.values()
    assert loss == pytest.approx(plain_loss, rel=1e-4)
    assert accuracy == plain_accuracy
    assert accuracy >= 95.0
    worst = float(re.search(r"largest relative difference .*: ([\d.e+-]+)", done.stdout)[1])
    assert worst < 1e-4


def test_hf_trainer_fine_tunes_pipelined_and_saves_a_folder_from_pretrained_loads(tmp_path):
    """examples/hf_trainer.py under torchrun, 2 CPU processes: the evaluation loss falls, and
    the saved folder gives the trained model's loss back."""
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    out = tmp_path / "llama"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "hf_trainer.py"), "--steps", "24", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = re.search(r"eval loss ([\d.]+) -> ([\d.]+) in 24 steps", done.stdout)
    reloaded = re.search(r"from_pretrained\(.*\): eval loss ([\d.]+)", done.stdout)
    assert losses and reloaded, done.stdout[-3000:]
    before, after = float(losses[1]), float(losses[2])
    assert after < before - 1.5, done.stdout[-3000:]  # from about ln 258 = 5.55
    assert abs(float(reloaded[1]) - after) < 1e-3
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_grpo_runs_rollouts_logprobs_and_updates_in_one_layout():
    """examples/grpo.py, a few steps: generate, forward_only and step(microbatches=...) in the
    same two processes; its full run's rising reward is in docs/generation.md."""
    argv = ["--steps", "3", "--prompts", "4", "--group", "4"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "grpo.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"^step   3: mean reward [\d.]+, \d+% right$", out, re.M), out
    assert re.search(r"^mean reward [\d.]+ -> [\d.]+ \(first and last 5 steps\)$", out, re.M), out
