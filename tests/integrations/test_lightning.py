"""gpipe.integrations.lightning: a LightningModule written for one device trains through
PipelineStrategy on two processes to the losses and weights it reaches on one device, and
what the strategy cannot honour is refused in one line."""

import os

import pytest

pytest.importorskip("lightning", reason="the lightning extra installs lightning")

import torch

from ..small_models import mlp
from ..workers import run
from . import lightning_cases as cases

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def test_two_stages_give_the_losses_and_weights_of_one_device(tmp_path):
    one = cases.train("auto", 1, tmp_path / "one.ckpt")
    one_resumed = cases.train("auto", 1, tmp_path / "one.ckpt", resume=True)
    ranks = run(cases.pipelined, 2, (tmp_path / "two.ckpt",))
    assert ranks[0] == ranks[1]  # every rank logs the same
    two, two_resumed = ranks[0]
    assert len(two["returned"]) == len(one["returned"]) == 12
    # the sanity check, after each epoch, validate()
    assert len(two["validated"]) == len(one["validated"]) == 4
    for key in ("returned", "logged", "validated"):
        torch.testing.assert_close(two[key], one[key], **EXACT)
    torch.testing.assert_close(two["validate"], one["validate"], **EXACT)
    # rank 0's checkpoint holds the whole module, under the one-device names
    saved = torch.load(tmp_path / "two.ckpt", weights_only=False)["state_dict"]
    reference = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    assert list(saved) == list(reference)
    torch.testing.assert_close(saved, reference, **EXACT)
    loaded = cases.Regression.load_from_checkpoint(tmp_path / "two.ckpt")
    torch.testing.assert_close(dict(loaded.state_dict()), reference, **EXACT)
    # resumed from its checkpoint (weights, each stage's momentum, the schedule), a third epoch
    assert len(two_resumed["returned"]) == len(one_resumed["returned"]) == 6
    for key in ("returned", "validated"):
        torch.testing.assert_close(two_resumed[key], one_resumed[key], **EXACT)


def test_a_network_built_on_the_meta_device_trains_alike_on_one_stage_or_two(
    tmp_path, one_process_world
):
    """Built in configure_model, the network is allocated stage by stage and initialized by
    gpipe from its seed and each layer's index, whatever the number of stages; resumed, it
    takes its weights from the checkpoint once its stage is built."""
    ranks = run(cases.pipelined_on_the_meta_device, 2, (tmp_path / "two.ckpt",))
    ranks_resumed = {rank: resumed for rank, (_, resumed) in ranks.items()}
    ranks = {rank: trained for rank, (trained, _) in ranks.items()}
    one = cases.on_the_meta_device(1, tmp_path / "one.ckpt")
    assert ranks[0]["built_on"] == ranks[1]["built_on"] == one["built_on"] == "meta"
    whole = sum(p.numel() for p in mlp().parameters())
    assert one["held"] == whole
    assert ranks[0]["held"] + ranks[1]["held"] == whole  # each rank allocated its stage
    for key in ("returned", "validated"):
        assert ranks[0][key] == ranks[1][key]
        torch.testing.assert_close(ranks[0][key], one[key], **EXACT)
    saved = torch.load(tmp_path / "two.ckpt", weights_only=False)["state_dict"]
    reference = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    assert list(saved) == list(reference)
    torch.testing.assert_close(saved, reference, **EXACT)
    one_resumed = cases.on_the_meta_device(1, tmp_path / "one.ckpt", resume=True)
    assert len(one_resumed["returned"]) == len(ranks_resumed[0]["returned"]) == 6
    assert ranks_resumed[0]["returned"][0] < 0.5 * ranks[0]["returned"][0]  # not from scratch
    torch.testing.assert_close(ranks_resumed[0]["returned"], one_resumed["returned"], **EXACT)


@pytest.fixture
def one_process_world():
    """Lightning joins a process group of this one process and sets its environment; both
    are undone after the test."""
    import torch.distributed as dist

    saved, joined_before = dict(os.environ), dist.is_initialized()
    yield
    if dist.is_initialized() and not joined_before:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"chunks": 0}, "chunks must be a positive integer, got 0"),
        ({"schedule": "fifo"}, "fifo"),
        ({"data_parallel": 2}, "PipelineStrategy(data_parallel=...) is not supported"),
        ({"device": "cpu"}, "PipelineStrategy sets device itself"),
        ({"chunk": 4}, "PipelineStrategy got an unexpected argument 'chunk'"),
        ({"loss_fn": "mse"}, "loss_fn must be callable, got str"),
        ({"balance": "2,2"}, "balance must be a list of ints, got '2,2'"),
        ({"balance": [2, 0]}, "all balance numbers must be positive integers"),
    ],
)
def test_arguments_it_cannot_take_are_refused_in_one_line(arguments, message):
    with pytest.raises((ValueError, TypeError)) as refused:
        cases.PipelineStrategy(**arguments)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def _scaled_precision():
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize(
    "module, trainer, message",
    [
        (cases.Manual, {}, "PipelineStrategy needs automatic optimization"),
        (cases.Regression, {"plugins": [_scaled_precision()]}, "precision='16-mixed'"),
        (cases.Regression, {"sync_batchnorm": True}, "Trainer(sync_batchnorm=True)"),
        (cases.TwoNetworks, {}, "TwoNetworks has 2 (net, head): pass PipelineStrategy(network="),
        (cases.ParameterOutside, {}, "has parameters outside it, which no stage would train"),
        (cases.NoLoss, {}, "pass loss_fn=... or give NoLoss a loss_fn(outputs, targets)"),
        (cases.DictBatches, {"batches": "dict"}, "takes a batch as a pair (inputs, targets)"),
        (cases.NetworkUncalled, {}, "training_step did not call self.net"),
        (cases.Regression, {"swa": True}, "StochasticWeightAveraging is not honoured"),
    ],
    ids=["manual", "fp16", "syncbn", "two-nets", "outside", "loss", "dict", "uncalled", "swa"],
)
def test_what_it_cannot_honour_is_refused_in_one_line(one_process_world, module, trainer, message):
    if trainer.pop("swa", False):  # built here: a callback is the Trainer's once given
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        trainer["callbacks"] = [StochasticWeightAveraging(swa_lrs=0.1)]
    if trainer.pop("batches", None) == "dict":
        x, y = cases.loaders()[0].dataset.tensors
        trainer["batches"] = [{"pair": (x[:4], y[:4])}]
    with pytest.raises((ValueError, TypeError, RuntimeError)) as refused:
        cases.fit_on_one_process(module(), **trainer)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_resuming_a_checkpoint_saved_without_the_pipeline_is_refused_in_one_line(
    tmp_path, one_process_world
):
    trainer = cases.L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(cases.Regression(), cases.loaders()[0])
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="saved without PipelineStrategy") as refused:
        cases.fit_on_one_process(cases.Regression(), ckpt_path=tmp_path / "plain.ckpt")
    assert "\n" not in str(refused.value)


def test_a_module_pipelined_by_an_earlier_trainer_goes_on_with_a_new_one(one_process_world):
    """A second Trainer (with a PipelineStrategy of its own) validates and fits the module
    the first left pipelined (it wrapped the pipeline in another); one cut otherwise is
    refused in one line."""
    module = cases.Regression()
    cases.fit_on_one_process(module)
    pipe = module.net
    _, val = cases.loaders()
    trainer = cases.L.Trainer(
        strategy=cases.PipelineStrategy(chunks=2), accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, max_steps=2,
    )  # fmt: skip
    (validated,) = trainer.validate(module, val, verbose=False)
    assert validated["val_loss"] > 0 and module.net is pipe
    cases.fit_on_one_process(module)
    assert module.net is pipe
    with pytest.raises(ValueError, match="pipelined by an earlier run with chunks=2") as refused:
        cases.L.Trainer(
            strategy=cases.PipelineStrategy(chunks=3), accelerator="cpu", devices=1,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
        ).validate(module, val, verbose=False)  # fmt: skip
    assert "\n" not in str(refused.value)


def test_the_loss_lightning_gets_back_has_the_steps_dtype(one_process_world):
    """The pipeline sums its micro-batches' losses in float64; a step of a float32 module
    returns its loss in float32, as on one device (it came back as float64)."""

    class Dtypes(cases.L.Callback):
        def __init__(self) -> None:
            self.seen: list[torch.dtype] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seen.append(outputs["loss"].dtype)

    module = cases.Regression()
    module.net.float()
    x, y = cases.loaders()[0].dataset.tensors
    rows = cases.TensorDataset(x[:16].float(), y[:16].float())
    dtypes = Dtypes()
    cases.fit_on_one_process(
        module, batches=cases.DataLoader(rows, batch_size=8), callbacks=[dtypes]
    )
    assert dtypes.seen == [torch.float32, torch.float32]
