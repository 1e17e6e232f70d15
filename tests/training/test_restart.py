"""Runs that survive a lost process: a rank killed with SIGKILL (at a step, while it writes a
checkpoint, or with its whole torchrun "node"; the first two in one short soak run, as
benchmarks/soak.py does at length) is restarted by torchrun's agent and the run
continues by itself from its newest good checkpoint, with the losses of a run never
interrupted; a damaged newest checkpoint is skipped for the one before, with a warning.

Every run that loses a process is real processes over gloo: ``gpipe train`` started as a
command, by itself or by two torchrun agents that meet at a rendezvous store this test holds;
the uninterrupted reference trains on the module's shared processes. The kill is a real
SIGKILL, planned through ``GPIPE_TEST_KILL`` (gpipe.training.elastic) at a step the test picks.
"""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from gpipe.cli import main
from gpipe.training.checkpoints.format import verify_checkpoint
from gpipe.training.checkpoints.resuming import continuing_line
from gpipe.training.run_lock import holding_run_folder

from ..workers import training_on_shared_processes

RUN = [
    "--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--chunks", "4", "--lr", "1e-2",
    "--warmup", "2", "--eval-every", "5", "--sample-tokens", "16", "--quiet", "--balance", "even",
    "--steps", "12", "--save-every", "3", "--timeout", "10", "--threads", "1",
]  # fmt: skip
WAIT = 240  # seconds any one command may take before the test fails


def _losses(run) -> dict[int, float]:
    """Loss by step, from a log that holds each step once (a restart's log is trimmed to its
    checkpoint before it logs the steps after it again)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    return {r["step"]: r["loss"] for r in records}


def _train(*args, kill=None):
    """``gpipe train`` as a command of its own, with a planned kill."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if kill is not None:
        env["GPIPE_TEST_KILL"] = json.dumps(kill)
    command = [sys.executable, "-m", "gpipe.cli", "train", *RUN, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env)


def _checkpoints(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 2 stages, 12 steps, a checkpoint every 3. Nothing is lost in
    it, so it trains on the module's shared processes (its losses are those of the same run
    as a command; the runs below compare theirs to it)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    with training_on_shared_processes():
        assert main(["train", *RUN, "--stages", "2", "--out", str(out)]) == 0
    return out


def _resumed_from(step: int) -> str:
    """What the restarted run says when it continues from the checkpoint of ``step``."""
    return f"step-{step:06d}: training from step {step}" if step else "training from step 0"


def _resumed_as_expected(text: str, lost_at: int) -> bool:
    """Whether the restarted run, a process lost as it started step ``lost_at``, went on from
    the newest checkpoint saved before that step, or (saves run in the background) from the
    one before it, if that one was still being written."""
    newest = 3 * ((lost_at - 1) // 3)
    return any(_resumed_from(saved) in text for saved in {newest, max(newest - 3, 0)})


def test_a_short_soak_a_rank_killed_at_a_random_step_and_one_in_a_save(reference, tmp_path):
    """benchmarks/soak.py's short version: a random rank killed as a random step starts, and
    rank 0 killed once its share of step 9's files is written, which leaves only
    ``.step-000009.partial``. Restarted twice, the run goes on from finished checkpoints only
    and ends with the losses and the checkpoints of the run never interrupted."""
    from benchmarks.soak import judge, train

    rank, step = random.randint(0, 1), random.randint(1, 12)
    kills = [
        {"rank": rank, "step": step, "at": "step", "once": str(tmp_path / "kill-0")},
        {"rank": 0, "step": 9, "at": "save", "once": str(tmp_path / "kill-1")},
    ]
    out = tmp_path / "run"
    done = train(out, [*RUN, "--stages", "2", "--max-restarts", "2"], kills, interval=0.2,
                 timeout=WAIT)  # fmt: skip
    case = f"rank {rank} killed at step {step}"
    assert done.returncode == 0, f"{case}: {done.stderr[-3000:]}"
    assert f"process {rank} terminated with signal SIGKILL" in done.stderr, case
    assert "process 0 terminated with signal SIGKILL" in done.stderr, case
    assert _resumed_as_expected(done.stdout, step), case
    assert _resumed_from(6) in done.stdout, case  # step 9 never finished: from 6
    verdict = judge(done, out, None, reference, kills, keep=3)
    failed = [key for key, ok in verdict.items() if key.startswith("ok_") and not ok]
    assert not failed, f"{case}: {failed}, {verdict}"
    assert _losses(out) == _losses(reference), case
    assert _checkpoints(out) == _checkpoints(reference), case  # the partial folder is gone
    assert verify_checkpoint(out / "checkpoints" / "step-000009") == []


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(reference, tmp_path):
    """Step 12's second data file cut short: the resume warns, naming it, takes step 9 and
    trains steps 10 to 12 again as they were."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    damaged = out / "checkpoints" / "step-000012"
    data = damaged / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    done = _train("--resume", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DamagedCheckpointWarning" in done.stderr
    assert f"checkpoint {damaged} is damaged (__1_0.distcp has" in done.stderr
    assert f"resumed from {out / 'checkpoints' / 'step-000009'}" in done.stdout
    assert _losses(out) == _losses(reference)
    assert verify_checkpoint(damaged) == []  # written whole again


class _Nodes:
    """Two torchrun agents of one job on this machine, as on two machines: they meet at a
    rendezvous store this test holds, so that neither is special and either may be lost."""

    def __init__(
        self, tmp_path, nnodes: str, kills: list[dict | None], *conf: str, train=()
    ) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=WAIT)
        )
        self.out = tmp_path / "run"
        self.logs = [tmp_path / f"node{n}.log" for n in range(2)]
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
            "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{self.store.port}", "--rdzv-id", "gpipe-test",
            "--rdzv-conf", ",".join(["is_host=0", *conf]), "--max-restarts", "1",
            "--monitor-interval", "0.1",
            "-m", "gpipe.cli", "train", *RUN, *train, "--out", str(self.out),
        ]  # fmt: skip
        self.processes = []
        for log, kill in zip(self.logs, kills, strict=True):
            env = os.environ | {"OMP_NUM_THREADS": "1"}
            if kill is not None:
                env["GPIPE_TEST_KILL"] = json.dumps(kill)
            with open(log, "w") as f:
                self.processes.append(
                    subprocess.Popen(
                        command, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )

    def wait(self) -> list[int | None]:
        """Each agent's exit code; one still running after WAIT seconds is killed (None)."""
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=WAIT))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                codes.append(None)
        return codes

    def output(self) -> str:
        return "".join(log.read_text() for log in self.logs)


def test_two_torchrun_nodes_train_together_and_survive_a_lost_rank(reference, tmp_path):
    step = random.randint(2, 12)
    once = tmp_path / "killed"
    nodes = _Nodes(tmp_path, "2", [{"rank": 1, "step": step, "once": str(once)}] * 2)
    codes = nodes.wait()
    case = f"rank 1 killed at step {step}"
    text = nodes.output()
    assert codes == [0, 0], f"{case}: {codes}\n{text[-4000:]}"
    assert once.exists(), case
    assert "lost stage" in text, case  # the survivor names the stage it lost
    assert _resumed_as_expected(text, step), case
    assert json.loads((nodes.out / "run.json").read_text())["train"]["stages"] == 2
    assert _losses(nodes.out) == _losses(reference), case


def test_a_lost_node_leaves_one_stage_that_repartitions_and_goes_on(reference, tmp_path):
    """``--nnodes 1:2``: the second node (agent and worker) is lost as step 8 starts; the
    first restarts alone, as one stage over all four layers, from step 6 saved by two (saved
    in the foreground, so that step 6 is surely complete when step 8 starts). The lost agent
    leaves the rendezvous once it has missed its heartbeats for 5 s (1 s apart; torchrun's
    default is 15 s, 5 s apart), which the survivor's new round waits for."""
    once = tmp_path / "killed"
    kill = {"step": 8, "at": "node", "once": str(once)}
    conf = ["last_call_timeout=5", "keep_alive_interval=1", "keep_alive_max_attempt=5"]
    nodes = _Nodes(tmp_path, "1:2", [None, kill], *conf, train=["--sync-save"])
    codes = nodes.wait()
    text = nodes.output()
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, f"{codes}\n{text[-4000:]}"
    assert "restarted from " in text and "step-000006: training from step 6, stages [4]" in text
    checkpoints = nodes.out / "checkpoints"
    for step, stages in ((6, 2), (9, 1), (12, 1)):
        description = json.loads((checkpoints / f"step-{step:06d}" / "gpipe.json").read_text())
        assert description["stages"] == stages, step
    ours, theirs = _losses(nodes.out), _losses(reference)
    assert sorted(ours) == sorted(theirs)
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5, abs=0), step


@pytest.mark.parametrize(
    ("value", "torchrun", "expected"),
    [
        ("-1", False, "--max-restarts must not be negative, got -1"),
        ("2", True, "--max-restarts 2: under torchrun, restarts are torchrun's; pass torchrun "
         "--max-restarts instead"),
    ],
)  # fmt: skip
def test_bad_max_restarts_is_refused(capsys, monkeypatch, tmp_path, value, torchrun, expected):
    if torchrun:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.setenv(name, "1")
    assert main(["train", "--max-restarts", value, "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == f"gpipe: error: {expected}"
    assert not (tmp_path / "run").exists()


def test_a_run_folder_in_use_by_another_run_is_refused(reference, tmp_path, capsys):
    """A second run pointed at a folder a run is training in, to continue it or to replace
    it, is refused before it writes anything, naming the process that holds it; once that
    run ends the folder is free again."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with holding_run_folder(out):  # as the launching process of a run holds it while it trains
        assert main(["train", "--resume", str(out), "--steps", "13"]) == 2
        assert main(["train", *RUN, "--stages", "2", "--out", str(out), "--force"]) == 2
    for line in capsys.readouterr().err.splitlines():
        assert line == (
            f"gpipe: error: run folder {out} is in use by another run (process {os.getpid()} "
            f"on {socket.gethostname()} holds {out / '.gpipe.lock'}); two runs in one folder "
            "would write over each other's checkpoints: wait for it to end, or pass another --out"
        )
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    with holding_run_folder(out):  # free again
        pass


def test_a_run_folder_that_cannot_be_written_is_named_in_one_line(reference, tmp_path, capsys):
    """(A read-only or full disk: the run record cannot be written; here its temporary file's
    name is taken by a folder, which fails the same way whoever runs the test.)"""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / ".run.json.tmp").mkdir()
    assert main(["train", "--resume", str(out), "--steps", "13"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gpipe: error: --resume {out}: cannot write the run folder (Is a directory: "
        f"{out / '.run.json.tmp'})"
    )


def test_an_out_folder_that_cannot_be_made_is_named_in_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run"
    assert main(["train", "--out", str(out), "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gpipe: error: --out {out}: cannot write the run folder (Not a directory: {out})"
    )


def test_force_never_empties_a_folder_through_a_link(tmp_path, capsys):
    """A linked --out may lead anywhere: --force refuses rather than empty its target."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious.txt").write_text("kept")
    link = tmp_path / "out"
    link.symlink_to(target)
    assert main(["train", "--out", str(link), "--force", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"gpipe: error: --out {link} is a link to {target}: --force empties a run folder "
        "only when given the folder itself"
    )
    assert (target / "precious.txt").read_text() == "kept"


def test_a_failed_run_says_what_it_can_continue_from(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newest = out / "checkpoints" / "step-000012"
    expected = f"newest complete checkpoint: {{}}; gpipe train --resume {out} continues"
    assert continuing_line(out) == expected.format(newest)
    (newest / "manifest.json").unlink()  # a save cut short: the one before
    assert continuing_line(out) == expected.format(out / "checkpoints" / "step-000009")
    shutil.rmtree(out / "checkpoints")
    assert continuing_line(out) == (
        f"no checkpoint of {out} was completed: the run would start again from step 0"
    )
