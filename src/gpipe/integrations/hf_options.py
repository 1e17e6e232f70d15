"""What a pipelined ``Trainer`` is asked that it cannot do: each refused in one line that
names the option, before any process starts working.

Everything else a ``TrainingArguments`` sets is honoured by the ``Trainer`` itself (the
schedule of the learning rate, logging, saving, seeds, reporting) or mapped onto the pipeline
(``bf16`` to its autocast, ``gradient_checkpointing`` to re-materializing every stage).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from gpipe.engine import ScheduleSource

__all__ = [
    "check_own",
    "check_own_loss",
    "check_trainer_arguments",
    "parts_of",
    "refused_options",
    "stages_of",
]


def _set(value: Any) -> bool:
    return bool(value)


def _given(value: Any) -> bool:
    return value is not None


def _beyond_reentrancy(value: Any) -> bool:
    """Checkpointing options other than ``use_reentrant``: the pipeline re-materializes whole
    stages with PyTorch's non-reentrant checkpoint, which gives the gradients that either
    ``use_reentrant`` does, and has nothing to honour the others with (``every_n_layers``,
    offloading)."""
    return bool(value) and bool(set(value) - {"use_reentrant"})


# (argument, is it asked for, why the pipeline cannot honour it)
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("deepspeed", _given, "DeepSpeed shards the model its own way"),
    ("fsdp", _set, "FSDP shards the whole model; use data_parallel= for replicas"),
    ("parallelism_config", _given, "the pipeline lays out the processes itself"),
    ("torch_compile", _set, "the stages run uncompiled"),
    ("fp16", _set, "float16 needs loss scaling that the Trainer's loop keeps; use bf16"),
    ("fp16_full_eval", _set, "the stages keep their dtype; use bf16 for mixed precision"),
    ("bf16_full_eval", _set, "the stages keep their dtype; use bf16 for mixed precision"),
    (
        "activation_checkpointing_kwargs",
        _beyond_reentrancy,
        "the pipeline re-materializes whole stages (gradient_checkpointing=True, with "
        "use_reentrant at most)",
    ),
    (  # its name before transformers 5
        "gradient_checkpointing_kwargs",
        _beyond_reentrancy,
        "the pipeline re-materializes whole stages (gradient_checkpointing=True, with "
        "use_reentrant at most)",
    ),
    ("label_smoothing_factor", _set, "the pipeline's loss is the plain causal-LM loss"),
    ("neftune_noise_alpha", _given, "it hooks the whole model's embedding"),
    ("use_liger_kernel", _set, "Liger patches the whole model's forward"),
    ("auto_find_batch_size", _set, "a failed step cannot be retried on every stage alike"),
    (
        "train_sampling_strategy",
        lambda v: v == "batch_rebalance",
        "it shards batches over every process, not over the replicas",
    ),
    ("load_best_model_at_end", _set, "the best checkpoint is not read back into the stages"),
    ("eval_use_gather_object", _set, "metrics are gathered over the replicas as tensors"),
    (
        "loss_type",
        lambda v: v is not None and v not in ("nll", ["nll"]),
        "the pipeline trains the causal-LM loss (nll) on its last stage",
    ),
)


def refused_options(args: Any) -> list[str]:
    """One line for each option of ``args`` (a ``TrainingArguments``, or a TRL config built
    on it) that the pipeline cannot honour; empty when it honours them all."""
    found = []
    for name, asked, why in _REFUSED:
        value = getattr(args, name, None)
        if asked(value):
            found.append(f"TrainingArguments({name}={value!r}): {why}")
    if getattr(getattr(args, "accelerator_config", None), "dispatch_batches", None):
        found.append(
            "TrainingArguments(accelerator_config.dispatch_batches=True): the first process "
            "would read every batch, not each replica its own"
        )
    return found


_TRAINER_REFUSED = {
    "model_init": "pass the model itself: every rank cuts it before training",
    "compute_loss_func": "the pipeline computes the causal-LM loss on its last stage",
}


def check_trainer_arguments(args: Any, kwargs: Mapping[str, Any], model: Any) -> None:
    """Raise one line for the first thing asked of the trainer that the pipeline cannot
    do: an option of ``args``, a ``Trainer`` argument in ``kwargs``, or the ``model``."""
    refused = refused_options(args) if args is not None else []
    if refused:
        raise ValueError(f"PipelineTrainer cannot honour {refused[0]}")
    for name, why in _TRAINER_REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"PipelineTrainer cannot take {name}=: {why}")
    optimizers = kwargs.get("optimizers") or (None, None)
    if optimizers[0] is not None:
        raise ValueError(
            "PipelineTrainer cannot take optimizers=(optimizer, ...): an optimizer built "
            "before the cut holds every stage's parameters; pass optimizer_cls_and_kwargs="
        )
    if model is None or isinstance(model, str):
        raise ValueError(
            "PipelineTrainer needs the model itself (built the same way on every rank, or "
            f"with its parameters on the meta device and weights=), got {model!r}"
        )
    if not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(
            "PipelineTrainer pipelines Hugging Face models (a PreTrainedModel, such as "
            f"AutoModelForCausalLM gives), got a {type(model).__name__}"
        )
    if getattr(model, "peft_config", None) is not None:
        raise ValueError("PipelineTrainer cannot pipeline a PEFT model: pass the base model")
    if not _causal_lm(type(model)):
        raise ValueError(
            "PipelineTrainer trains causal language models (a ...ForCausalLM, as "
            "AutoModelForCausalLM gives), whose shifted-label loss its last stage computes; "
            f"got a {type(model).__name__}"
        )


def _causal_lm(model_class: type) -> bool:
    """Whether ``model_class`` is (or derives from) a causal LM class of ``transformers``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(
        c.__name__ in names or c.__name__.endswith("ForCausalLM") for c in model_class.__mro__
    )


def check_own_loss(trainer_class: type, pipelined_class: type) -> None:
    """Refuse a ``compute_loss`` of the user's own in ``trainer_class``'s bases: the
    pipeline computes the loss on its last stage, so it would never run (the libraries'
    own, such as TRL's, only add metrics)."""
    for base in trainer_class.__mro__:
        if base is pipelined_class or base.__module__.split(".")[0] in ("transformers", "trl"):
            continue
        if "compute_loss" in vars(base):
            raise ValueError(
                f"PipelineTrainer cannot run {base.__name__}.compute_loss: the pipeline "
                "computes the causal-LM loss on its last stage, so a loss of your own would "
                "never run"
            )


def check_own(chunks: object, schedule: object, data_parallel: object) -> None:
    """Refuse a bad ``chunks``, ``schedule`` or ``data_parallel`` (the pipeline's own)."""
    for name, value in (("chunks", chunks), ("data_parallel", data_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a schedule's name, got {type(schedule).__name__}")
    if schedule == "auto":
        raise ValueError(
            "schedule='auto' is not taken by PipelineTrainer: it times the model on a sample "
            "batch before the Trainer has one; name a schedule of gpipe.schedules.SCHEDULES"
        )
    ScheduleSource.of(schedule)  # an unknown name is refused here, before the process group


def parts_of(schedule: str, stages: int) -> int:
    """The parts to cut the model into for ``stages`` processes a pipeline under
    ``schedule``: two a process under a V schedule (``zero-bubble-v``, ``v-half``)."""
    return ScheduleSource.of(schedule).parts(stages)


def stages_of(args: Any, data_parallel: int) -> int:
    """K, the stages of each of the ``data_parallel`` pipelines over this world, which the
    ``Trainer`` (its ``args``) must see whole."""
    if not dist.is_initialized():
        raise ValueError(
            "PipelineTrainer runs one stage per process and found no process group: launch "
            "the script with torchrun --nproc-per-node K*D (K stages, D=data_parallel)"
        )
    world = dist.get_world_size()
    if args.world_size != world:
        raise ValueError(
            f"torchrun started {world} processes but the TrainingArguments see "
            f"{args.world_size}: on a machine without GPUs pass use_cpu=True, as the plain "
            "Trainer needs it to run on several processes"
        )
    if args.device.type == "cuda" and "gloo" not in str(dist.get_backend()):
        raise ValueError(
            f"the process group's backend is {dist.get_backend()!r}: the pipeline also moves "
            "small CPU tensors between processes; pass ddp_backend='cpu:gloo,cuda:nccl'"
        )
    if world % data_parallel:
        raise ValueError(
            f"the world size {world} is not K x D for data_parallel D={data_parallel}: launch "
            f"K*{data_parallel} processes (torchrun --nproc-per-node K*{data_parallel})"
        )
    return world // data_parallel
