"""Opening a checkpoint runs no code from it: a run folder edited by someone else, with its
manifest's digests updated to match, is met with the previous checkpoint (``--resume``, an
automatic restart) or one line and exit code 2 (``gpipe sample``, ``gpipe export``), and the
code its pickles name never runs (each attack's payload would create a marker file).

Every run is ``gpipe train`` over real processes and gloo; the allow-list is checked against
the metadata that the installed PyTorch writes for a plain and a sharded checkpoint.
"""

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gpipe.cli import main
from gpipe.models import GPTConfig, build_gpt
from gpipe.training.checkpoints.format import (
    DamagedCheckpointWarning,
    latest_checkpoint,
    load_model_weights,
    verify_checkpoint,
)
from gpipe.training.checkpoints.safe_reading import (
    METADATA_FILE,
    METADATA_GLOBALS,
    CheckpointRefused,
    read_metadata,
    refusals,
)

from ..workers import training_on_shared_processes

TINY = [
    "--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--chunks", "2",
    "--lr", "1e-2", "--warmup", "2", "--eval-every", "3", "--sample-tokens", "4", "--quiet",
    "--balance", "even", "--timeout", "20", "--threads", "1",
]  # fmt: skip

pytestmark = pytest.mark.usefixtures("train_on_shared_processes")


class _WritesMarker:
    """A pickle that, when unpickled by plain ``pickle``, creates a file: the attack."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _losses(run) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _update_manifest(checkpoint) -> None:
    """What an attacker does after editing files: digests that match them again."""
    files = {}
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and path.name != "manifest.json":
            data = path.read_bytes()
            files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))


def _poison_metadata(checkpoint, marker) -> None:
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(_WritesMarker(marker)))
    _update_manifest(checkpoint)


def _poison_data(checkpoint, marker, tmp_path) -> None:
    """The checkpoint written again whole, with consistent metadata, but its step stored as
    a pickle that names a callable: the ``.distcp`` file carries the attack."""
    _rewritten(checkpoint, tmp_path, step=_WritesMarker(marker))


def _rewritten(checkpoint, tmp_path, **items) -> None:
    """The checkpoint written again whole, with consistent metadata, ``items`` replaced."""
    whole = tmp_path / "whole.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(checkpoint, whole)
    state = torch.load(whole, weights_only=False)  # the test's own file
    state.update(items)
    for path in checkpoint.iterdir():
        if path.name.endswith(".distcp") or path.name == METADATA_FILE:
            path.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=checkpoint, no_dist=True)
    _update_manifest(checkpoint)


def _edit_json(path, edit) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 stages, 6 steps, checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("safety") / "run"
    args = ["train", *TINY, "--stages", "2", "--steps", "6", "--save-every", "3"]
    with training_on_shared_processes():
        assert main([*args, "--out", str(out)]) == 0
    return out


@pytest.fixture
def copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _step(run, step):
    return run / "checkpoints" / f"step-{step:06d}"


def _one_line_error(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


class _Recorder(pickle.Unpickler):
    """Plain unpickling of the suite's own files, noting every global the pickle names."""

    def __init__(self, file, seen):
        super().__init__(file)
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


def _globals_of(metadata_file) -> set:
    seen: set = set()
    with open(metadata_file, "rb") as f:
        _Recorder(f, seen).load()
    return seen


def _outside_allow_list(seen) -> set:
    dtypes = {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return seen - METADATA_GLOBALS - dtypes


def test_the_allow_list_covers_what_pytorch_writes_for_a_plain_and_a_sharded_checkpoint(
    run, tmp_path
):
    """Every global in the metadata the installed PyTorch writes is on the allow-list (a new
    class in a later PyTorch fails here first), and those checkpoints read and load."""
    sharded = tmp_path / "sharded"
    args = ["train", *TINY, "--stages", "1", "--data-parallel", "2", "--shard", "full"]
    assert main([*args, "--steps", "2", "--save-every", "1", "--out", str(sharded)]) == 0
    for checkpoint in (_step(run, 3), _step(run, 6), _step(sharded, 1), _step(sharded, 2)):
        assert _outside_allow_list(_globals_of(checkpoint / METADATA_FILE)) == set()
        read_metadata(checkpoint)
        assert refusals(checkpoint) == [] and verify_checkpoint(checkpoint) == []
    config = GPTConfig.from_dict(json.loads((run / "run.json").read_text())["model"])
    load_model_weights(_step(sharded, 2), build_gpt(config))


def test_a_foreign_global_is_refused_before_it_is_called(tmp_path):
    checkpoint = tmp_path / "c"
    checkpoint.mkdir()
    marker = tmp_path / "ran"
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(_WritesMarker(marker)))
    with pytest.raises(CheckpointRefused, match=r"names posix\.system"):
        read_metadata(checkpoint)
    assert not marker.exists()


def test_resume_of_a_poisoned_newest_checkpoint_goes_on_from_the_one_before(copy, run, capsys):
    marker = copy.parent / "ran"
    _poison_metadata(_step(copy, 6), marker)
    warned = re.escape(f"checkpoint {_step(copy, 6)} is damaged (.metadata refused: it names")
    with pytest.warns(DamagedCheckpointWarning, match=warned):
        assert main(["train", "--resume", str(copy), "--steps", "6", "--quiet"]) == 0
    assert not marker.exists()
    losses = _losses(copy)
    assert sorted(losses) == list(range(1, 7))
    reference = _losses(run)
    for step in (4, 5, 6):  # repeated from step 3, as the original run trained them
        assert losses[step] == pytest.approx(reference[step], rel=1e-5), step


def _tampered(checkpoint, **fields) -> None:
    """The checkpoint's metadata rewritten with ``fields`` replaced: a pickle of DCP's own
    classes, which the allow-list passes, whose values no longer describe the files."""
    metadata = dataclasses.replace(read_metadata(checkpoint), **fields)
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    _update_manifest(checkpoint)


def _shapes(checkpoint) -> dict:
    """Tamperings of the metadata of ``checkpoint``, by what each does."""
    metadata = read_metadata(checkpoint)
    stored = metadata.storage_data
    first = next(iter(stored))
    described = metadata.state_dict_metadata
    return {
        "no storage map": {"storage_data": None},
        "a storage map that is a list": {"storage_data": list(stored.values())},
        "an empty storage map": {"storage_data": {}},
        "no state": {"state_dict_metadata": {}},
        "an entry that is a number": {"state_dict_metadata": {**described, first.fqn: 7}},
        "an item past its file's end": {
            "storage_data": {**stored, first: dataclasses.replace(stored[first], length=2**40)}
        },
    }


def test_metadata_whose_values_do_not_describe_its_files_is_refused(copy):
    """Each tampering passes the allow-list, and each used to end in a traceback deep in a
    load (or a MemoryError reading 1 TiB): now a refusal in one line, before any load."""
    checkpoint = _step(copy, 6)
    original = (checkpoint / METADATA_FILE).read_bytes()
    for what, fields in _shapes(checkpoint).items():
        _tampered(checkpoint, **fields)
        found = refusals(checkpoint)
        assert len(found) == 1 and "\n" not in found[0], (what, found)
        assert found[0].startswith((".metadata is not whole", "__0_0.distcp ends before")), (
            what,
            found,
        )
        (checkpoint / METADATA_FILE).write_bytes(original)
    (checkpoint / "linked").symlink_to(checkpoint / METADATA_FILE)
    with pytest.raises(CheckpointRefused, match="is a link"):
        read_metadata(checkpoint, "linked")


def test_resume_of_a_newest_checkpoint_that_stores_nothing_goes_on_from_the_one_before(copy, run):
    _tampered(_step(copy, 6), storage_data={})
    with pytest.warns(
        DamagedCheckpointWarning, match=r"\.metadata is not whole: '[^']+' is not stored\); skipped"
    ):
        assert main(["train", "--resume", str(copy), "--steps", "6", "--quiet"]) == 0
    losses, reference = _losses(copy), _losses(run)
    assert losses[6] == pytest.approx(reference[6], rel=1e-5)


def test_a_saved_step_that_is_no_step_stops_resume_naming_the_checkpoint(copy, tmp_path, capsys):
    """A value of the allowed types where gpipe saves another (the step as text): the run
    stops with the checkpoint named, not int()'s bare complaint."""
    _rewritten(_step(copy, 6), tmp_path, step="not a step")
    assert main(["train", "--resume", str(copy), "--steps", "7", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert f"{_step(copy, 6)}: its saved state is not what gpipe saves (its step is " in err


def test_a_distcp_file_whose_pickle_names_a_callable_is_refused(copy, tmp_path, capsys):
    marker = tmp_path / "ran"
    _poison_data(_step(copy, 6), marker, tmp_path)
    (refusal,) = refusals(_step(copy, 6))
    assert refusal.startswith("__0_0.distcp refused: ") and "posix.system" in refusal
    err = _one_line_error(capsys, "sample", copy, "--tokens", "2")
    assert f"{_step(copy, 6)}: damaged checkpoint (__0_0.distcp refused" in err
    assert f"the newest that verifies is {_step(copy, 3)}" in err
    with pytest.warns(DamagedCheckpointWarning, match="distcp refused.*skipped for an older"):
        assert main(["train", "--resume", str(copy), "--steps", "6", "--quiet"]) == 0
    assert not marker.exists()


def test_sample_and_export_stop_with_one_line(copy, capsys):
    marker = copy.parent / "ran"
    for step in (3, 6):
        _poison_metadata(_step(copy, step), marker)
    for argv in (["sample", copy], ["sample", _step(copy, 3)], ["export", copy, "--hf", "o"]):
        err = _one_line_error(capsys, *argv)
        assert "damaged checkpoint (.metadata refused: it names posix.system" in err
    err = _one_line_error(capsys, "train", "--resume", copy, "--steps", "9")
    assert "no checkpoint there can be opened (step-000006: .metadata refused" in err
    assert "step-000003: .metadata refused" in err
    assert not marker.exists()


def test_a_record_that_does_not_fit_its_tensors_stops_generate_in_one_line(copy, tmp_path, capsys):
    """A ``gpipe.json`` describing a wider model than its tensors (the manifest matching):
    every stage's load fails alike, and the command says why in one line (it ended in
    tracebacks of every process)."""
    step = _step(copy, 6)
    for record in (step / "gpipe.json", copy / "run.json"):  # the run's own model, as said
        _edit_json(record, lambda r: r["model"].update(d_model=2 * r["model"]["d_model"]))
    _update_manifest(step)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [1, 2]}\n')
    out = tmp_path / "out.jsonl"
    argv = ["generate", step, "--prompts", prompts, "--out", out, "--max-new-tokens", "2"]
    err = _one_line_error(capsys, *argv, "--quiet")
    assert f"{step}: its tensors do not fit the model it describes: Size mismatch" in err


def test_records_of_unexpected_types_are_refused(copy, capsys):
    """A ``gpipe.json`` of the wrong types is a damaged checkpoint; a ``run.json`` one is
    refused in one line."""
    _edit_json(_step(copy, 6) / "gpipe.json", lambda r: r["model"].update(n_layer="two"))
    _update_manifest(_step(copy, 6))
    err = _one_line_error(capsys, "sample", copy)
    assert "model.n_layer is 'two' (str), expected int" in err
    with pytest.warns(DamagedCheckpointWarning, match="expected int.*skipped for an older"):
        assert main(["train", "--resume", str(copy), "--steps", "6", "--quiet"]) == 0
    capsys.readouterr()
    _edit_json(copy / "run.json", lambda r: r["train"].update(steps=[1]))
    err = _one_line_error(capsys, "train", "--resume", copy)
    assert "run.json: not a record gpipe wrote: train.steps is [1] (list), expected int" in err


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda r: r["train"].update(precision="fp8"), "precision is 'fp8', not one of"),
        (lambda r: r.update(balance=[]), "balance is []: expected layers per stage"),
        (  # shown cut short, on one line of readable length
            lambda r: r.update(balance=[1] * 4096),
            "balance [1, 1, 1, 1, 1, 1, 1, 1, ... (4096 stages)] cuts 4096 layers, not 4",
        ),
        (lambda r: r.update(balance=[1, 1, 2]), "holds 3 stages, not a multiple of its 2"),
        (lambda r: r["model"].update(vocab_size=0), "vocab_size is 0, expected at least 1"),
        (lambda r: r.update(step=-3), "step is -3"),
    ],
    ids=["precision", "no-stages", "4096-stages", "3-stages", "vocab", "step"],
)
def test_records_of_the_right_types_and_wrong_values_are_refused(copy, capsys, edit, said):
    """Values that start processes or size tensors (``gpipe sample`` started one process
    for each entry of the balance; a precision unknown was a KeyError in the stages)."""
    _edit_json(_step(copy, 6) / "gpipe.json", edit)
    _update_manifest(_step(copy, 6))
    err = _one_line_error(capsys, "sample", _step(copy, 6))
    assert "not a record gpipe wrote" in err and said in err, err


def test_a_manifest_pointing_outside_the_folder_is_damage(copy, tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("x")
    checkpoint = _step(copy, 6)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["../../../outside"] = {"bytes": 1, "sha256": "0"}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(DamagedCheckpointWarning, match="not a file of the checkpoint's folder"):
        assert latest_checkpoint(copy / "checkpoints") == _step(copy, 3)


def test_code_a_run_folder_names_runs_only_when_the_user_names_it(copy, capsys):
    """A checkpoint that says its model is ``os:abort`` (a module of the user's own, as far as
    it claims) is not built unless ``--model os:abort`` is given: were it, this test's process
    would abort."""
    fields = {"source": "os:abort", "vocab_size": 256, "seq_len": 32}
    for record in (_step(copy, 6) / "gpipe.json", copy / "run.json"):
        _edit_json(record, lambda r: r.update(model=fields))
    _update_manifest(_step(copy, 6))
    err = _one_line_error(capsys, "sample", copy)
    assert "names code to run, --model os:abort" in err
    err = _one_line_error(capsys, "train", "--resume", copy)
    assert "names code to run, --model os:abort" in err


def test_an_automatic_restart_skips_a_poisoned_checkpoint(copy, run, tmp_path):
    """Resumed from step 3 (its step 6 poisoned), the run loses a process at step 5, before
    it writes step 6 again: the restart finds the poisoned step 6 newest, warns, and goes on
    from step 3 with the same losses."""
    marker = tmp_path / "ran"
    _poison_metadata(_step(copy, 6), marker)
    kill = {"rank": 1, "step": 5, "at": "step", "once": str(tmp_path / "killed")}
    env = os.environ | {"OMP_NUM_THREADS": "1", "GPIPE_TEST_KILL": json.dumps(kill)}
    command = [sys.executable, "-m", "gpipe.cli", "train", "--resume", str(copy)]
    command += ["--steps", "6", "--max-restarts", "1", "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "killed").exists()
    assert done.stderr.count(f"checkpoint {_step(copy, 6)} is damaged (.metadata refused") >= 2
    assert not marker.exists()
    losses, reference = _losses(copy), _losses(run)
    for step in range(1, 7):
        assert losses[step] == pytest.approx(reference[step], rel=1e-5), step


def test_a_stored_tensor_unlike_its_metadata_is_refused(copy):
    """Metadata of DCP's own classes that sends one tensor to another's bytes (a larger
    one: DCP narrowed it to fit and loaded it without a word) or gives it another dtype
    (DCP cast it) is a damaged checkpoint, skipped for the one before."""
    checkpoint = _step(copy, 6)
    metadata = read_metadata(checkpoint)
    stored = metadata.storage_data
    position = next(i for i in stored if i.fqn == "model.0.position")
    token = next(i for i in stored if i.fqn == "model.0.token.weight")
    _tampered(checkpoint, storage_data={**stored, position: stored[token]})
    (refusal,) = refusals(checkpoint)
    assert refusal == (
        "__0_0.distcp holds model.0.position as torch.float32 [256, 32], "
        "where its metadata says torch.float32 [32, 32]"
    )
    metadata = read_metadata(checkpoint)
    entry = metadata.state_dict_metadata["model.0.position"]
    entry.properties = dataclasses.replace(entry.properties, dtype=torch.float16)
    _tampered(checkpoint, storage_data=stored, state_dict_metadata=metadata.state_dict_metadata)
    with pytest.warns(DamagedCheckpointWarning, match=r"\[32, 32\], where its metadata says "):
        assert latest_checkpoint(copy / "checkpoints") == _step(copy, 3)


def test_links_in_a_checkpoint_are_damage_and_retention_removes_only_the_link(copy, tmp_path):
    """A checkpoint's file that is a link (its record read from elsewhere), and a checkpoint
    folder that is one, are damaged; retention removes such a folder's link, never what it
    points at, and a save of the same step replaces it."""
    from gpipe.training.checkpoints.format import finish_save
    from gpipe.training.checkpoints.retention import Retention, prune_checkpoints

    outside = tmp_path / "outside"
    shutil.copytree(_step(copy, 3), outside)
    record = _step(copy, 6) / "gpipe.json"
    record.unlink()
    record.symlink_to(outside / "gpipe.json")
    _update_manifest(_step(copy, 6))
    assert "gpipe.json is a link" in verify_checkpoint(_step(copy, 6))[0]
    for step in (9, 12):
        _step(copy, step).symlink_to(outside)
    assert verify_checkpoint(_step(copy, 12), checksums=False) == [
        "step-000012 is a link; a run's checkpoints lie in its own folder"
    ]
    prune_checkpoints(copy / "checkpoints", Retention(keep=1), written=_step(copy, 3))
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == [
        "step-000003",
        "step-000006",
        "step-000009",
        "step-000012",
    ]  # the links are newer than the step written: damaged, kept for people to look at
    shutil.copytree(_step(copy, 3), copy / "checkpoints" / ".step-000012.partial")
    finish_save(copy / "checkpoints", 12, {"saved": "again"}, None)  # replaced the link
    assert not _step(copy, 12).is_symlink()
    prune_checkpoints(copy / "checkpoints", Retention(keep=1), written=_step(copy, 12))
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step-000012"]
    assert {p.name for p in outside.iterdir()} == {p.name for p in _step(copy, 12).iterdir()}


def test_retention_never_counts_a_skipped_checkpoint_as_the_newest_good_one(copy):
    """Resumed from step 3 past a step 6 whose contents are damaged (its sizes whole), the
    run saves step 4: with --keep 1, step 4 stays (it was removed, with step 3, leaving
    only the damaged step 6, so a restart had nothing to continue from)."""
    from gpipe.training.checkpoints.retention import Retention, prune_checkpoints

    shutil.copytree(_step(copy, 3), _step(copy, 4))
    damaged = _step(copy, 6) / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    removed = prune_checkpoints(copy / "checkpoints", Retention(keep=1), written=_step(copy, 4))
    assert removed == [_step(copy, 3)]
    assert [p.name for p in sorted((copy / "checkpoints").iterdir())] == [
        "step-000004",
        "step-000006",
    ]


def test_a_checkpoint_of_another_model_is_skipped_on_resume(copy):
    """A checkpoint copied in from another run (its record names another model than the
    run's run.json) is damage: resume goes on from the one before (the processes failed
    loading it into the run's model)."""
    _edit_json(_step(copy, 6) / "gpipe.json", lambda r: r["model"].update(d_model=64))
    _update_manifest(_step(copy, 6))
    said = r"holds another model than its run's .*run\.json \(they differ in d_model\)"
    with pytest.warns(DamagedCheckpointWarning, match=said):
        assert latest_checkpoint(copy / "checkpoints", run=True) == _step(copy, 3)


def test_resume_refuses_a_run_folder_whose_outputs_are_links(copy, tmp_path, capsys):
    """A run folder whose sample.txt links outside it: continuing it wrote the sample over
    the file linked to; now one line, before any process starts."""
    precious = tmp_path / "precious"
    precious.write_text("mine")
    (copy / "sample.txt").unlink(missing_ok=True)
    (copy / "sample.txt").symlink_to(precious)
    err = _one_line_error(capsys, "train", "--resume", copy, "--steps", "7", "--quiet")
    assert f"{copy / 'sample.txt'} is a link to {precious}, and the run would write" in err
    assert precious.read_text() == "mine"


def test_export_refuses_a_tokenizer_folder_whose_files_link_outside_it(tmp_path):
    """The run's tokenizer folder holds a link named like a tokenizer file to a key: it was
    copied into the export; links inside the folder, or into a Hugging Face cache's blobs,
    still are."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from gpipe.training.hf.export import tokenizer_files

    from ..text_cases import word_tokenizer

    raw = Tokenizer.from_file(str(word_tokenizer(tmp_path / "t.json")))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    snapshot = tmp_path / "models--a--b" / "snapshots" / "rev"
    fast.save_pretrained(tmp_path / "saved")
    (tmp_path / "models--a--b" / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in (tmp_path / "saved").iterdir():
        blob = tmp_path / "models--a--b" / "blobs" / file.name
        file.rename(blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{file.name}")
    assert "tokenizer.json" in tokenizer_files(snapshot)
    secret = tmp_path / "id_rsa"
    secret.write_text("SECRET")
    (snapshot / "vocab.txt").symlink_to(secret)
    with pytest.raises(ValueError, match=r"vocab\.txt is a link to .*id_rsa, outside the tok"):
        tokenizer_files(snapshot)
