"""PipelineConfig (the options of a Pipeline, typed and checked where they are given) and the
build step it feeds (gpipe.pipeline_assembly), on a world of one process: what the options
refuse before any process group work, what they settle, and that a Pipeline built from a
config is the one its keyword arguments build."""

import dataclasses

import pytest
import torch
from torch import nn

from gpipe import Pipeline, PipelineConfig
from gpipe.pipeline_assembly import agreed_balance, assemble
from gpipe.runtime.recompute import Layers
from gpipe.schedules import get_schedule


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"checkpoint": "sometimes"}, "checkpoint"),
        ({"schedule": "no-such-schedule"}, "no-such-schedule"),
        ({"schedule": "auto", "balance": [1, 2]}, "balance"),
        ({"chunks": 0}, "chunks"),
        ({"chunks": True}, "chunks"),
        ({"loss_reduction": "max"}, "loss_reduction"),
        ({"loss_fn": "mse"}, "loss_fn"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"timeout": "soon"}, "timeout"),
    ],
)
def test_a_bad_option_is_refused_at_construction_naming_it(options, named):
    with pytest.raises((ValueError, TypeError), match=named):
        PipelineConfig(**options)


def test_options_are_settled_as_they_run():
    config = PipelineConfig(chunks=4.0, timeout=5, checkpoint=Layers(every=2))
    assert config.chunks == 4 and isinstance(config.chunks, int)
    assert config.timeout == 5.0 and isinstance(config.timeout, float)
    assert config.checkpoint == Layers(every=2)
    assert not config.auto and PipelineConfig(schedule="auto").auto
    # chunks=None: the schedule's own count (a fixed Schedule's), else one micro-batch
    assert PipelineConfig().microbatches() == 1
    assert PipelineConfig(schedule=get_schedule("1f1b")(2, 3)).microbatches() == 3
    # a changed copy is checked again
    with pytest.raises(ValueError, match="chunks"):
        dataclasses.replace(config, chunks=-1)
    assert PipelineConfig(**config.options()) == config


def test_a_given_schedule_is_validated_once(monkeypatch):
    """Validation replays every program (a second for a large schedule): once per config,
    however often its schedule and micro-batches are asked for."""
    import gpipe.engine.step_schedule as step_schedule  # to count what it validates

    validated = []
    original = step_schedule.validate
    monkeypatch.setattr(step_schedule, "validate", lambda s: validated.append(s) or original(s))
    config = PipelineConfig(schedule=get_schedule("1f1b")(2, 4))
    assert config.microbatches() == 4 and config.schedule_source().name == "1f1b"
    assert len(validated) == 1
    with pytest.raises(TypeError, match="unhashable"):
        hash(config)


def test_a_model_is_checked_against_the_options_before_any_group_is_joined():
    config = PipelineConfig(autocast=torch.float32)
    with pytest.raises(ValueError, match="autocast"):
        config.check_model(_model(), torch.device("cpu"), None)
    with pytest.raises(ValueError, match="overlap_stages"):
        PipelineConfig(overlap_stages=True).check_model(_model(), torch.device("cpu"), None)


def test_from_config_builds_the_pipeline_its_keyword_arguments_build(one_process_group):
    config = PipelineConfig(chunks=2, loss_fn=nn.functional.mse_loss, device="cpu", timeout=10)
    by_config = Pipeline.from_config(_model(), config)
    by_keywords = Pipeline(_model(), **config.options())
    assert by_config.config == by_keywords.config == config
    assert (by_config.balance, by_config.chunks, by_config.schedule_name) == ([3], 2, "gpipe")
    x = torch.randn(4, 4, dtype=torch.double)
    y = torch.randn(4, 2, dtype=torch.double)
    loss = by_config.step(x, y)
    expected = nn.functional.mse_loss(_model()(x), y)
    torch.testing.assert_close(loss, expected.detach())
    assert [n for n, _ in by_config.named_parameters()] == [
        n for n, _ in _model().named_parameters()
    ]
    with pytest.raises(TypeError, match="config must be a PipelineConfig"):
        Pipeline.from_config(_model(), config.options())  # type: ignore[arg-type]


def test_the_build_step_on_one_rank_holds_every_stage(one_process_group):
    assembly = assemble(_model(), PipelineConfig(chunks=3, device="cpu"), sample=None, group=None)
    assert (assembly.rank, assembly.n_ranks) == (0, 1)
    assert assembly.cut.balance == [3] and assembly.cut.chunks == 3
    assert assembly.cut.auto_choice is None
    assert sorted(assembly.built.layers) == ["0", "1", "2"]
    assert assembly.runner.schedules.step(3, True).n_microbatches == 3
    # one rank decides the cut for all: by layer count without a sample
    assert agreed_balance(_model(), 2, None, device="cpu") == [2, 1]
