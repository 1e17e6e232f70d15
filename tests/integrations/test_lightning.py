"""gpipe.integrations.lightning: a LightningModule written for one device trains through
PipelineStrategy on two processes to the losses and weights it reaches on one device, and
what the strategy cannot honour is refused in one line."""

import pytest

pytest.importorskip("lightning", reason="the lightning extra installs lightning")

import torch  # noqa: E402

from ..workers import run  # noqa: E402
from . import lightning_cases as cases  # noqa: E402

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def test_two_stages_give_the_losses_and_weights_of_one_device(tmp_path):
    one = cases.train("auto", 1, tmp_path / "one.ckpt")
    ranks = run(cases.pipelined, 2, (tmp_path / "two.ckpt",))
    assert ranks[0] == ranks[1]  # every rank logs the same
    two = ranks[0]
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
