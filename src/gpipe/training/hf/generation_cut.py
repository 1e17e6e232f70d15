"""Generating from a run whose Hugging Face model was traced.

A causal LM whose class declares no pipeline plan (GPT-2, BLOOM, ...) is cut by tracing in
``gpipe train``, and traced stages keep no KV cache. To generate, each rank cuts the model
again, at the run's own places, by the layout ``gpipe.split(plan="hf")`` reads from its
modules, and gives its stage the weights its traced stage holds (the same parameters, by
their original names). On the meta device ``split`` cannot run the model to check that
layout, so it is checked here on the run's weights: one forward of a probe batch through
both cuts must give the same logits, or the traced stages stay and generation is refused
as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from gpipe.comm.process_group import bounded_wait
from gpipe.engine.generation import GenerationRefused
from gpipe.engine.generation.lanes import cache_refusal
from gpipe.errors import first_line
from gpipe.pipeline import Pipeline
from gpipe.splitting import PlanError, SplitModel, split
from gpipe.splitting.hf_layout import same_to_rounding
from gpipe.training.hf.models import build_hf_meta
from gpipe.training.models.sources import TrainModel, logits_of

__all__ = ["cut_for_generation"]

MakePipeline = Callable[[nn.Sequential, list[int]], Pipeline]


def cut_for_generation(
    traced_pipe: Pipeline, traced: nn.Sequential, model: TrainModel, make: MakePipeline
) -> Pipeline:
    """``traced_pipe`` where its stages keep a KV cache (or are no Hugging Face model's);
    otherwise a pipeline of the stages the model's layout cuts at the same places (built by
    ``make(stages, balance)``, collective as ``Pipeline`` is) on the same tensors, once a
    probe batch gives the same logits through both. Where that cannot be, it raises
    ``GenerationRefused`` saying why, the same on every rank."""
    if not isinstance(traced, SplitModel) or model.kind != "hf" or model.packed:
        return traced_pipe
    if cache_refusal(traced[0], 0) is None:  # they generate as they are
        return traced_pipe
    stages = _plan_stages(traced, model)
    # this rank's new stages take its traced stages' tensors themselves (assigned to their
    # parameters on meta): no second copy, and the pipeline keeps real layers as they are
    mine = nn.ModuleList(stages[index] for index in traced_pipe.stages)
    stages.load_original_state_dict(traced.original_state_dict(module=traced_pipe), module=mine)
    pipe = make(stages, [1] * len(stages))
    probe = _probe(model)
    traced_pipe.eval()  # no dropout: both cuts compute the same function
    pipe.eval()
    expected = traced_pipe.forward(model.inputs(probe))
    try:  # a stage that fails raises on every rank (StageError), each then says so below
        same = _same_logits(expected, pipe.forward(probe))
    except Exception:
        same = False
    verdict = torch.tensor([int(same)])  # the last rank's, told to the others
    work = dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=pipe.group, async_op=True)
    bounded_wait(work, pipe.timeout, pipe.stage_index, "the check of the cut for generation")
    if verdict.item() != 1:
        raise _refused("the stages of that layout do not compute what the traced stages do")
    return pipe


def _plan_stages(traced: SplitModel, model: TrainModel) -> SplitModel:
    """The model cut on meta at the run's places by the layout read from its modules, each
    stage holding what its traced stage holds (decided alike on every rank: nothing here
    runs or communicates)."""
    at = list(model.split_at or [])
    try:
        stages = split(build_hf_meta(model.hf_config or ""), at=at, plan="hf")
    except (PlanError, ValueError, KeyError) as exc:
        raise _refused(first_line(exc)) from None
    if len(stages) != len(traced) or _held(stages) != _held(traced):
        raise _refused(f"the run's cut, at {at}, is not between its decoder layers")
    return stages


def _refused(why: str) -> GenerationRefused:
    return GenerationRefused(
        "generate() needs stages that keep a KV cache, and the run traced its Hugging Face "
        f"model (traced stages keep none); it cannot be cut again by its modules' layout: {why}"
    )


def _held(stages: SplitModel) -> list[set[str]]:
    """The original names of the parameters each stage holds."""
    return [
        {stages.original_name(f"{index}.{name}") for name, _ in stage.named_parameters()}
        for index, stage in enumerate(stages)
    ]


def _probe(model: TrainModel) -> torch.Tensor:
    """Two rows of token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(model.vocab_size, (2, min(model.seq_len, 8)), generator=generator)


def _same_logits(traced: object, cut: object) -> bool:
    """On the last stage, whether the two cuts' logits agree to rounding (they run the same
    modules on the same rows); True elsewhere, where there are none."""
    if traced is None or cut is None:
        return True
    return same_to_rounding(logits_of(cut).float(), logits_of(traced).float())
