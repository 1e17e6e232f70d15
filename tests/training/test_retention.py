"""Retention keeps the newest verified checkpoints and the milestones, never the last good one
lost; the background writer saves the state as it was at ``save``, one save at a time."""

import pytest
import torch

from gpipe.training.checkpoints.format import checkpoint_dirs, load_model_weights, verify_checkpoint
from gpipe.training.checkpoints.retention import Retention, prune_checkpoints
from gpipe.training.checkpoints.writer import CheckpointWriter

# one process, no process group: torch.distributed.checkpoint says it saves as one process
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _steps(root):
    return [int(p.name.split("-")[1]) for p in checkpoint_dirs(root)]


def _model():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters())


def _save_all(root, steps, **writer_options):
    model, optimizer = _model()
    writer = CheckpointWriter(root, **writer_options)
    weights = {}
    for step in steps:
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        writer.save(step, model, optimizer, {"step": step}, {"what": "test"})
        weights[step] = model.weight.detach().clone()
        with torch.no_grad():  # changed while the save may still be writing
            model.weight.add_(1.0)
    writer.close()
    return writer, weights


@pytest.fixture(scope="module")
def nine(tmp_path_factory):
    """Steps 1 to 9, every checkpoint kept."""
    root = tmp_path_factory.mktemp("nine")
    _save_all(root, range(1, 10), retention=Retention(keep=None), background=False)
    return root


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_the_newest_keep_and_the_milestones_stay(nine, tmp_path):
    root = _copy(nine, tmp_path / "c")
    removed = prune_checkpoints(root, Retention(keep=2, keep_every=4))
    assert _steps(root) == [4, 8, 9]
    assert [int(p.name.split("-")[1]) for p in removed] == [1, 2, 3, 5, 6, 7]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_damaged_ones_never_count_and_the_last_good_one_stays(nine, tmp_path):
    root = _copy(nine, tmp_path / "c")
    (root / "step-000009" / "manifest.json").unlink()  # newest damaged: left for people
    (root / "step-000008" / ".metadata").unlink()
    (root / "step-000003" / ".metadata").unlink()  # older than the newest good one: useless
    prune_checkpoints(root, Retention(keep=1))
    assert _steps(root) == [7, 8, 9]
    for path in checkpoint_dirs(root):
        (path / "manifest.json").unlink(missing_ok=True)
    assert prune_checkpoints(root, Retention(keep=1)) == []  # none good: nothing removed
    assert _steps(root) == [7, 8, 9]


@pytest.mark.parametrize("background", [True, False])
def test_the_writer_keeps_what_was_saved_and_prunes_as_it_goes(tmp_path, background):
    writer, weights = _save_all(
        tmp_path, range(1, 6), retention=Retention(keep=2), background=background
    )
    assert _steps(tmp_path) == [4, 5]
    assert writer.last == tmp_path / "step-000005"
    assert [p.name for p in writer.removed] == ["step-000001", "step-000002", "step-000003"]
    for step in (4, 5):
        path = tmp_path / f"step-{step:06d}"
        assert verify_checkpoint(path) == []
        model, _ = _model()
        load_model_weights(path, model)
        assert torch.equal(model.weight, weights[step])  # the state at save(), not after


def test_a_failed_background_save_is_raised_by_the_next_wait(tmp_path):
    model, optimizer = _model()
    writer = CheckpointWriter(tmp_path)

    def lost() -> None:
        raise OSError("disk full")

    writer.save(1, model, optimizer, {"step": 1}, {}, on_written=lost)
    with pytest.raises(RuntimeError, match="step 1 failed: OSError: disk full$") as caught:
        writer.wait()
    assert isinstance(caught.value.__cause__, OSError)
    assert checkpoint_dirs(tmp_path) == []  # only a .partial folder, never loaded


def test_an_abandoned_save_says_so(tmp_path, capsys):
    import threading

    model, optimizer = _model()
    writer = CheckpointWriter(tmp_path)
    release = threading.Event()
    writer.save(7, model, optimizer, {"step": 7}, {}, on_written=release.wait)
    writer.abandon()
    release.set()
    assert "checkpoint of step 7 abandoned while being written" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"keep": 0}, {"keep": -1}, {"keep_every": -5}])
def test_retention_refuses_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Retention(**bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_background_save_of_a_model_on_a_gpu_copies_it_out_first(tmp_path):
    model = torch.nn.Linear(3, 2).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3, device="cuda")).sum().backward()
    optimizer.step()
    saved = model.weight.detach().cpu()
    writer = CheckpointWriter(tmp_path)
    writer.save(1, model, optimizer, {"step": 1}, {})
    with torch.no_grad():
        model.weight.zero_()  # at once, on the GPU: the save holds its own copy
    assert writer.close() == tmp_path / "step-000001"
    loaded = torch.nn.Linear(3, 2)
    load_model_weights(tmp_path / "step-000001", loaded)
    assert torch.equal(loaded.weight, saved)


def test_a_helper_process_writes_as_the_thread_does_and_its_death_is_an_error(tmp_path):
    """``process=True`` in one process: the same checkpoints and retention; a helper that
    dies while writing is named by the next wait, and its checkpoint never appears."""
    writer, weights = _save_all(tmp_path, range(1, 4), retention=Retention(keep=2), process=True)
    assert _steps(tmp_path) == [2, 3] and [p.name for p in writer.removed] == ["step-000001"]
    model, _ = _model()
    load_model_weights(tmp_path / "step-000003", model)
    assert torch.equal(model.weight, weights[3])

    model, optimizer = _model()
    writer = CheckpointWriter(tmp_path, process=True)
    writer.save(4, model, optimizer, {"step": 4}, {})
    writer._helper._process.kill()  # the helper dies: the writer keeps no public handle on it
    with pytest.raises(RuntimeError, match="step 4 ended"):
        writer.wait()
    assert _steps(tmp_path) == [2, 3]
