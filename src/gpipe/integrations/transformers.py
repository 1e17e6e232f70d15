"""Hugging Face's ``Trainer``, pipelined: ``PipelineTrainer`` and ``pipelined(TrainerClass)``.

A script written for ``transformers.Trainer`` (or a TRL trainer built on it) changes two
lines and is launched with ``torchrun --nproc-per-node K*D``: every rank builds the same
model and arguments, and the trainer cuts the model into K stages, keeps its own, and trains
through ``gpipe.Pipeline`` on D replicas. Everything else stays the ``Trainer``'s: its loop,
learning-rate schedule, logging, callbacks, evaluation and checkpoints.

Where the ``Trainer`` would reach the whole model, the pipeline stands in:

- ``training_step`` runs the batches of one gradient-accumulation window as one pipelined
  step (their micro-batches in order), with the causal-LM loss the model itself computes:
  labels shifted, -100 ignored, summed and divided by the tokens counted over the window and
  the replicas, as ``Trainer`` passes ``num_items_in_batch`` to the model;
- ``prediction_step`` evaluates through the pipeline and gives every rank the last stage's
  loss and logits;
- the ``Accelerator`` sees one process per replica: data are sharded over the D replicas
  (the K stages of one see the same batches), gathered over them for metrics, the model is
  never wrapped in DDP, and gradients are clipped by their norm over every stage;
- ``save_model`` gathers the stages to rank 0, which writes one ordinary Hugging Face folder;
  a checkpoint holds that folder, each stage's optimizer state, and the ``Trainer``'s own
  files, and ``resume_from_checkpoint`` reads it back.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import recursively_apply
from torch import Tensor, nn
from torch.utils.data import DataLoader, RandomSampler
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer_utils import enable_full_determinism, set_seed

import gpipe
from gpipe.engine import IGNORE_INDEX, StepResult, logits_of
from gpipe.runtime.microbatch import scatter_payload
from gpipe.splitting import SplitModel
from gpipe.training.hf import LazyWeights, fill_unsaved_buffers

__all__ = ["PipelineTrainer", "PipelinedModel", "pipelined", "refused_options"]

# The model's inputs a traced split takes: the first stage's graph is traced on these keys.
_TRACED_INPUTS = ("input_ids", "attention_mask")
# Keys of a batch that are the targets, never the first stage's inputs.
_TARGETS = ("labels", "shift_labels")
_SCHEDULER = "scheduler.pt"  # as Trainer names it


def _optimizer_file(stage: int, stages: int) -> str:
    return f"optimizer.stage-{stage}-of-{stages}.pt"


# What the pipeline cannot honour, and why: (argument, is it asked for, the reason).
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "gradient_checkpointing",
        bool,
        "the pipeline re-materializes its stages itself (Pipeline's checkpoint=)",
    ),
    ("activation_checkpointing", bool, "the pipeline re-materializes its stages itself"),
    ("deepspeed", lambda v: v is not None, "DeepSpeed shards the model its own way"),
    ("fsdp", bool, "FSDP shards the whole model; use data_parallel= for replicas"),
    ("torch_compile", bool, "the stages run uncompiled"),
    ("fp16", bool, "float16 needs loss scaling the Trainer's loop does not share; use bf16"),
    ("fp16_full_eval", bool, "the stages keep their dtype; use bf16 for mixed precision"),
    ("bf16_full_eval", bool, "the stages keep their dtype; use bf16 for mixed precision"),
    ("label_smoothing_factor", bool, "the pipeline's loss is the plain causal-LM loss"),
    ("neftune_noise_alpha", lambda v: v is not None, "it hooks the whole model's embedding"),
    ("use_liger_kernel", bool, "Liger patches the whole model's forward"),
    ("auto_find_batch_size", bool, "a failed step cannot be retried on every stage alike"),
    ("parallelism_config", lambda v: v is not None, "the pipeline lays out the processes"),
    (
        "train_sampling_strategy",
        lambda v: v == "batch_rebalance",
        "it shards batches over every process, not over the replicas",
    ),
    ("load_best_model_at_end", bool, "the best checkpoint is not read back into the stages"),
    ("eval_use_gather_object", bool, "metrics are gathered over the replicas as tensors"),
)


def refused_options(args: TrainingArguments) -> list[str]:
    """One line for each ``TrainingArguments`` option that ``args`` sets and the pipeline
    cannot honour (none for arguments it can)."""
    found = []
    for name, asked, why in _REFUSED:
        value = getattr(args, name, None)
        if asked(value):
            found.append(f"TrainingArguments({name}={value!r}): {why}")
    dispatch = getattr(args.accelerator_config, "dispatch_batches", None)
    if dispatch:
        found.append(
            "TrainingArguments(accelerator_config.dispatch_batches=True): the first process "
            "would read every batch, not one per replica"
        )
    return found


def _refuse(args: Any, kwargs: Mapping[str, Any], model: Any) -> None:
    """Raise one line for the first thing asked of the trainer that the pipeline cannot do."""
    if isinstance(args, TrainingArguments):
        refused = refused_options(args)
        if refused:
            raise ValueError(f"PipelineTrainer cannot honour {refused[0]}")
    why = {
        "model_init": "pass the model itself: every rank cuts it before training",
        "compute_loss_func": "the pipeline computes the causal-LM loss on its last stage",
    }
    for name, reason in why.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"PipelineTrainer cannot take {name}=: {reason}")
    optimizers = kwargs.get("optimizers") or (None, None)
    if optimizers[0] is not None:
        raise ValueError(
            "PipelineTrainer cannot take optimizers=(optimizer, ...): an optimizer built "
            "before the cut holds every stage's parameters; pass optimizer_cls_and_kwargs"
        )
    if model is None or isinstance(model, str):
        raise ValueError(
            "PipelineTrainer needs the model itself (built the same way on every rank, or "
            f"on the meta device with weights=), got {model!r}"
        )
    if getattr(model, "peft_config", None) is not None:
        raise ValueError("PipelineTrainer cannot pipeline a PEFT model: pass the base model")


def _check_own(chunks: object, schedule: object, data_parallel: object) -> None:
    for name, value in (("chunks", chunks), ("data_parallel", data_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a schedule's name, got {type(schedule).__name__}")


def _stages_of(data_parallel: int) -> int:
    """K, the stages of each of the ``data_parallel`` pipelines over this world."""
    if not dist.is_initialized():
        raise ValueError(
            "PipelineTrainer runs one stage per process and found no process group: launch "
            "the script with torchrun --nproc-per-node K*D (K stages, D=data_parallel)"
        )
    world = dist.get_world_size()
    if world % data_parallel:
        raise ValueError(
            f"the world size {world} is not K x D for data_parallel D={data_parallel}: launch "
            f"K*{data_parallel} processes (torchrun --nproc-per-node K*{data_parallel})"
        )
    return world // data_parallel


def split_model(model: nn.Module, parts: int) -> SplitModel:
    """``model`` cut into ``parts`` stages: traced on ``input_ids`` and ``attention_mask``
    (on the meta device when its parameters are, so nothing is allocated)."""
    device = next(model.parameters()).device
    ids = torch.zeros(2, 8, dtype=torch.long, device=device)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return gpipe.split(model, (), example, parts=parts)


class PipelinedModel(nn.Module):
    """What ``trainer.model`` is: this rank's stage of the model, as ``.pipeline`` (a
    ``gpipe.Pipeline``, whose parameters are this module's), beside the model it was cut
    from (``.original``, for its config, its name and ``save_pretrained``).

    Calling it runs the pipeline's forward on the first stage's inputs and returns the last
    stage's outputs there (None on other ranks); its ``forward`` takes the original's
    arguments, so the ``Trainer`` keeps the same dataset columns.
    """

    def __init__(self, original: PreTrainedModel, pipeline: gpipe.Pipeline, split: SplitModel):
        super().__init__()
        self.pipeline = pipeline
        self.split = [split]  # in a list: its stages are not this module's (only pipeline's)
        self.original = [original]  # the same: its other stages' parameters are not ours
        self.config = original.config
        self.generation_config = getattr(original, "generation_config", None)
        self.main_input_name = getattr(original, "main_input_name", "input_ids")

        def run(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(run).bind(*args, **kwargs)
            inputs = {k: v for k, v in bound.arguments.items() if k in _TRACED_INPUTS}
            return self.pipeline(inputs)

        # Trainer keeps the dataset columns that the model's forward names (its signature)
        run.__signature__ = inspect.signature(original.forward)  # type: ignore[attr-defined]
        self.forward = run

    def floating_point_ops(self, inputs: Mapping[str, Any]) -> int:
        """The whole model's count, as the ``Trainer`` logs it (``total_flos``)."""
        return int(self.original[0].floating_point_ops(dict(inputs)))


class _ReplicaAccelerator(Accelerator):
    """Accelerate's view of the world as D processes, one per pipeline replica: data are
    sharded and gathered over the replicas (every stage of one replica sees its shard), the
    model is never wrapped, and gradients are clipped by their norm over every stage.

    ``PipelineTrainer`` re-classes the ``Accelerator`` the ``Trainer`` built (keeping every
    setting the ``Trainer`` chose for it) and then calls ``attach``.
    """

    pipe: gpipe.Pipeline

    def attach(self, pipe: gpipe.Pipeline) -> None:
        self.pipe = pipe

    @property
    def num_processes(self) -> int:
        return self.pipe.replicas.data_parallel if self.pipe.replicas is not None else 1

    @property
    def process_index(self) -> int:
        return self.pipe.replicas.replica if self.pipe.replicas is not None else 0

    def prepare_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return model  # placed and synchronized by the pipeline; no DDP around a stage

    def prepare_data_loader(self, data_loader: DataLoader, *args: Any, **kwargs: Any) -> Any:
        sampler = getattr(data_loader, "sampler", None)
        seedable = isinstance(sampler, RandomSampler) and self.use_seedable_sampler
        if not seedable and getattr(sampler, "generator", False) is None:
            # the stages of a replica must draw the same order: one generator, seeded alike
            seed = torch.tensor([int(torch.empty((), dtype=torch.int64).random_().item())])
            dist.broadcast(seed, src=0)
            sampler.generator = torch.Generator().manual_seed(int(seed))  # type: ignore[union-attr]
        return super().prepare_data_loader(data_loader, *args, **kwargs)

    def gather(self, tensor: Any) -> Any:
        if self.pipe.replicas is None:
            return tensor  # one replica: as a single process's accelerator returns it
        return recursively_apply(self._gather_one, tensor)

    def _gather_one(self, tensor: Tensor) -> Tensor:
        assert self.pipe.replicas is not None
        one = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(one) for _ in range(self.pipe.replicas.data_parallel)]
        dist.all_gather(parts, one, group=self.pipe.replicas.group)
        return torch.cat(parts)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Tensor:
        return self.pipe.clip_grad_norm_(float(max_norm), float(norm_type))


class _Pipelined:
    """The behaviour ``pipelined`` adds to a ``Trainer`` class (see ``PipelineTrainer``)."""

    # what the Trainer class below in the MRO provides
    args: TrainingArguments
    model: Any
    model_wrapped: Any
    accelerator: Accelerator
    callback_handler: Any
    optimizer: Any
    lr_scheduler: Any
    processing_class: Any
    model_accepts_loss_kwargs: bool
    current_gradient_accumulation_steps: int

    def __init__(
        self,
        *args: Any,
        chunks: int = 1,
        schedule: str = "gpipe",
        data_parallel: int = 1,
        weights: str | os.PathLike[str] | Mapping[str, Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_own(chunks, schedule, data_parallel)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        model = kwargs.get("model", args[0] if args else None)
        _refuse(training_args, kwargs, model)
        if isinstance(training_args, TrainingArguments):
            _stages_of(data_parallel)  # before the Trainer's own set-up
        super().__init__(*args, **kwargs)
        self._pending: list[tuple[dict[str, Any], Tensor]] = []
        self._divisor = 1.0
        self._build(chunks, schedule, data_parallel, weights)

    # -- the cut ------------------------------------------------------------------------------
    def _build(
        self,
        chunks: int,
        schedule: str,
        data_parallel: int,
        weights: str | os.PathLike[str] | Mapping[str, Tensor] | None,
    ) -> None:
        """Cut the model the ``Trainer`` holds, keep this rank's stage, and put the pipeline
        in the model's place (and the replicas' view into the ``Accelerator``)."""
        refused = refused_options(self.args)  # the Trainer (or TRL) may have set some
        if refused:
            raise ValueError(f"PipelineTrainer cannot honour {refused[0]}")
        original = self.model
        stages = _stages_of(data_parallel)
        split = split_model(original, stages)
        meta = any(p.is_meta for p in original.parameters())
        if meta and weights is None:
            raise ValueError(
                "the model's parameters are on the meta device: pass weights= (a Hugging "
                "Face folder, or a mapping by the model's names) for each rank to read its "
                "stage from"
            )
        self.pipeline = gpipe.Pipeline(
            split,
            chunks=chunks,
            schedule=schedule,
            data_parallel=data_parallel,
            loss_fn=self._stage_loss,
            loss_reduction="sum",
            device=self.args.device,
            autocast=torch.bfloat16 if self.args.bf16 else None,
            timeout=float(self.args.ddp_timeout),
        )
        if weights is not None:
            found = LazyWeights(weights) if not isinstance(weights, Mapping) else weights
            split.load_original_state_dict(found, module=self.pipeline)
        fill_unsaved_buffers(split, self.pipeline, original)
        _release_other_stages(original, split, self.pipeline)
        self.model = self.model_wrapped = PipelinedModel(original, self.pipeline, split)
        self.callback_handler.model = self.model
        # Trainer builds its Accelerator in one method with no hook for the class; re-classing
        # keeps every setting it chose (mixed precision, data loader options, state)
        self.accelerator.__class__ = _ReplicaAccelerator
        assert isinstance(self.accelerator, _ReplicaAccelerator)
        self.accelerator.attach(self.pipeline)
        # as the Trainer seeded before the model was cut, so the data order is the same
        if self.args.full_determinism:
            enable_full_determinism(self.args.seed)
        else:
            set_seed(self.args.seed)

    @property
    def split(self) -> SplitModel:
        """The split model: its stages, and the map between their names and the model's."""
        return self.model.split[0]  # type: ignore[no-any-return]

    # -- a step -------------------------------------------------------------------------------
    def _stage_loss(self, outputs: Any, targets: Tensor) -> Tensor:
        """The causal-LM loss of one micro-batch, as a share of the window's (last stage)."""
        logits = logits_of(outputs).float()
        summed = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1).to(logits.device),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return summed / self._divisor

    def _split_batch(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Any], Tensor]:
        """The first stage's inputs and the shifted targets of a ``Trainer`` batch."""
        if "labels" not in inputs and "shift_labels" not in inputs:
            raise ValueError(
                "PipelineTrainer trains causal language models on batches with labels; this "
                f"batch has {sorted(inputs)} (use a collator that sets labels, such as "
                "DataCollatorForLanguageModeling(mlm=False))"
            )
        takes = set(inspect.signature(self.model.forward).parameters)
        extra = [
            k
            for k, v in inputs.items()
            if k in takes and k not in _TRACED_INPUTS + _TARGETS and v is not None
        ]
        if extra:
            raise ValueError(
                f"PipelineTrainer passes the model {list(_TRACED_INPUTS)} only; this batch "
                f"also has {extra}"
            )
        stage_inputs = {k: inputs[k] for k in _TRACED_INPUTS if inputs.get(k) is not None}
        stage_inputs.setdefault("attention_mask", torch.ones_like(stage_inputs["input_ids"]))
        if inputs.get("shift_labels") is not None:
            targets = inputs["shift_labels"]
        else:
            targets = F.pad(inputs["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)
        return stage_inputs, targets

    def _window_divisor(self, counted: int, num_items_in_batch: Any) -> float:
        """What the window's summed loss is divided by, as the plain ``Trainer`` would: the
        tokens it counted (over the replicas unless ``average_tokens_across_devices`` is
        off), or with no count, the mean over each batch, averaged over the window."""
        replicas = self.pipeline.replicas.data_parallel if self.pipeline.replicas else 1
        if num_items_in_batch is None:
            return float(max(counted, 1) * self.current_gradient_accumulation_steps * replicas)
        per_replica = not self.args.average_tokens_across_devices
        return float(num_items_in_batch) * (replicas if per_replica else 1)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """One batch of the gradient-accumulation window; the window's last runs all of its
        micro-batches as one pipelined step and returns the window's loss (the others 0)."""
        model.train()
        self._pending.append(self._split_batch(inputs))
        zero = torch.zeros((), device=self.args.device)
        if not self.accelerator.sync_gradients:
            return zero
        window, self._pending = self._pending, []
        counted = sum(int((t != IGNORE_INDEX).sum()) for _, t in window)
        self._divisor = self._window_divisor(counted, num_items_in_batch)
        chunks = self.pipeline.chunks
        microbatches = [
            (x, y)
            for stage_inputs, targets in window
            for x, y in zip(
                scatter_payload(stage_inputs, chunks), targets.split(_sizes(targets, chunks))
            )
        ]
        loss = self.pipeline.step(microbatches=microbatches)
        assert isinstance(loss, Tensor)
        return loss.detach().to(zero)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The batch's loss (its tokens' mean over every replica's batch, as the plain
        ``Trainer`` reduces it), and unless ``prediction_loss_only`` its logits and labels,
        the same on every rank of the replica."""
        model.eval()
        labels = inputs.get("labels")
        stage_inputs, targets = self._split_batch(inputs)
        count = torch.tensor([int((targets != IGNORE_INDEX).sum())], dtype=torch.float64)
        replicas = self.pipeline.replicas
        if replicas is not None and self.args.average_tokens_across_devices:
            dist.all_reduce(count, group=replicas.group)
        per_replica = replicas.data_parallel if replicas is not None else 1
        if not self.args.average_tokens_across_devices:
            count *= per_replica
        self._divisor = float(count.clamp(min=1))
        result = self.pipeline.evaluate(stage_inputs, targets, return_outputs=True)
        assert isinstance(result, StepResult)
        loss = result.loss.detach().float().to(self.args.device)
        if prediction_loss_only:
            return loss, None, None
        last = logits_of(result.outputs) if result.outputs is not None else None
        return loss, self._from_last_stage(last), labels

    def _from_last_stage(self, tensor: Tensor | None) -> Tensor:
        """``tensor`` of the last stage, on every rank of this pipeline."""
        pipe = self.pipeline
        src = pipe.global_rank(pipe.rank_of(pipe.n_stages - 1))
        header: list[Any] = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
        dist.broadcast_object_list(header, src=src, group=pipe.group)
        shape, dtype = header[0]
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=pipe.device)
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=src, group=pipe.group)
        return tensor.to(self.args.device)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Rows per optimizer step: a replica's batch x accumulation x the D replicas."""
        replicas = self.pipeline.replicas.data_parallel if self.pipeline.replicas else 1
        return args.train_batch_size * args.gradient_accumulation_steps * replicas

    # -- saving and resuming ------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the whole model as one Hugging Face folder (``from_pretrained`` loads it):
        the first replica's stages send their weights, by the model's own names, to rank 0,
        which writes them with the model's ``save_pretrained``. Collective."""
        folder = output_dir if output_dir is not None else self.args.output_dir
        pipe = self.pipeline
        first_replica = pipe.replicas is None or pipe.replicas.replica == 0
        mine = self.split.original_state_dict(module=pipe) if first_replica else {}
        mine = {k: v.detach().to("cpu") for k, v in mine.items()}
        rank = dist.get_rank()
        pieces: list[dict[str, Tensor]] | None = [{}] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, pieces, dst=0)
        if rank == 0:
            assert pieces is not None
            whole = {k: v for piece in pieces for k, v in piece.items()}
            os.makedirs(folder, exist_ok=True)
            self.model.original[0].save_pretrained(folder, state_dict=whole)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(folder)
            torch.save(self.args, os.path.join(folder, "training_args.bin"))
        dist.barrier()

    # Trainer saves and loads the optimizer (and reads the weights back) in these private
    # methods only, each written for a model whole on every rank: a pipeline's stages each
    # keep their own optimizer state, and read their own weights.
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pipe = self.pipeline
        if pipe.replicas is None or pipe.replicas.replica == 0:  # replicas hold the same
            name = _optimizer_file(pipe.stage_index, pipe.n_stages)
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, name))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        pipe = self.pipeline
        file = Path(checkpoint) / _optimizer_file(pipe.stage_index, pipe.n_stages)
        if not file.is_file():
            raise ValueError(
                f"{checkpoint}: no {file.name}; a pipelined checkpoint holds one optimizer "
                f"file per stage, written by {pipe.n_stages} stages"
            )
        state = torch.load(file, map_location=pipe.device, weights_only=True)
        self.optimizer.load_state_dict(state)
        scheduler = torch.load(Path(checkpoint) / _SCHEDULER, weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self.split.load_original_state_dict(
            LazyWeights(resume_from_checkpoint), module=self.pipeline
        )

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The pipeline places its stage; the whole model (possibly on meta) stays put."""


def _sizes(targets: Tensor, chunks: int) -> list[int]:
    from gpipe.runtime.microbatch import split_sizes

    return split_sizes(targets.size(0), chunks)


def _release_other_stages(original: nn.Module, split: SplitModel, pipe: nn.Module) -> None:
    """Free the parameters this rank's stage does not hold, in the model and in the other
    stages of its split: they become meta tensors of the same shapes, so that the model
    still describes itself (its config, its parameter count) while holding only the stage."""
    kept = {id(p) for p in pipe.parameters()}
    held = {id(m) for m in pipe.modules()}
    for stage in split:
        if id(stage) not in held:
            stage.to("meta")
    released: dict[int, nn.Parameter] = {}
    for module in original.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in kept or param.is_meta:
                continue
            if id(param) not in released:
                meta = torch.empty_like(param, device="meta")
                released[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
            setattr(module, name, released[id(param)])


T = TypeVar("T", bound=type[Trainer])
_made: dict[type, type] = {}


def pipelined(trainer_class: T) -> T:
    """``trainer_class`` (``transformers.Trainer`` or a subclass, such as TRL's
    ``SFTTrainer``) with ``PipelineTrainer``'s behaviour: the same arguments plus
    ``chunks=``, ``schedule=``, ``data_parallel=`` and ``weights=``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"pipelined() takes a Trainer class, got {trainer_class!r}")
    if issubclass(trainer_class, _Pipelined):
        return trainer_class
    if trainer_class not in _made:
        name = f"Pipelined{trainer_class.__name__}"
        made = type(name, (_Pipelined, trainer_class), {"__doc__": PipelineTrainer.__doc__})
        made.__module__ = __name__
        _made[trainer_class] = made
    return _made[trainer_class]  # type: ignore[return-value]


class PipelineTrainer(_Pipelined, Trainer):
    """``transformers.Trainer`` over a pipeline of K stages and D replicas, launched with
    ``torchrun --nproc-per-node K*D``.

    Takes the ``Trainer``'s arguments, plus:

    Args:
        chunks: micro-batches per batch of ``per_device_train_batch_size`` rows (the batch
            of one pipeline replica); a gradient-accumulation window of G batches runs as
            one pipelined step of G x chunks micro-batches.
        schedule: the pipeline's schedule (``gpipe.schedules.SCHEDULES``), default gpipe.
        data_parallel: D, the replicas of the pipeline; K is the world size over D.
        weights: where each rank reads its stage's weights: a Hugging Face folder (as
            ``save_pretrained`` writes it) or a mapping by the model's own names, read
            lazily. Needed when the model is built on the meta device; otherwise its own
            weights are used.

    ``model`` is the whole Hugging Face causal LM, built the same way on every rank (each
    rank then frees the other stages' parameters), or built with its parameters on the meta
    device (``accelerate.init_empty_weights()``) and ``weights=``, so that no rank ever
    holds more than its stage. After construction ``trainer.model`` is a
    ``PipelinedModel`` and ``trainer.pipeline`` the ``gpipe.Pipeline``.
    """


_made[Trainer] = PipelineTrainer
