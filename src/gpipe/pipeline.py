"""Pipeline: one stage per process over torch.distributed, for models that need many devices.

Every rank runs the same script. Each holds and initializes only its own partition, runs its
program of the schedule, and exchanges boundary tensors with its neighbours point-to-point.

``Pipeline`` is three steps: its options as a typed, checked ``PipelineConfig``
(``gpipe.pipeline_config``), the build of this rank's stages and their collaborators from
them (``gpipe.pipeline_assembly``), and delegation to those collaborators: ``StepRunner``
(``self.runner``: steps, evaluation and forwards; ``gpipe.engine``), ``Generation``
(``generate``), ``Precision`` (autocast and loss scaling). Its layers are registered under
their names in the whole model, so ``state_dict`` and ``named_parameters`` read like the
original model's.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.engine import (
    IGNORE_INDEX,
    StepResult,
    StepTimes,
    clip_grad_norm_,
    forward_logprobs,
    given_microbatches,
)
from gpipe.engine.generation import Generation, GenerationRefused
from gpipe.parallel.sharding import Sharding
from gpipe.parallel.ties import counted as counted_once
from gpipe.pipeline_assembly import Assembly, agreed_balance, assemble
from gpipe.pipeline_config import PipelineConfig
from gpipe.runtime.microbatch import Batch
from gpipe.runtime.partitions import as_sequential
from gpipe.runtime.recompute import Layers
from gpipe.runtime.stage import LossFn
from gpipe.runtime.timeline import Event, merge
from gpipe.schedules import Schedule

if TYPE_CHECKING:
    from gpipe.parallel.tensor import PlanValue

__all__ = [
    "Pipeline",
    "PipelineConfig",
    "StepResult",
    "StepTimes",
    "agreed_balance",
]


def _need_loss_fn(loss_fn: LossFn | None, method: str, return_outputs: bool) -> None:
    if loss_fn is not None:
        return
    hint = (
        "; for the outputs alone, call the pipeline (pipe(inputs)), which runs the "
        "forward without a loss"
        if return_outputs or method == "evaluate"
        else ""
    )
    raise ValueError(
        f"{method}() needs a loss_fn; pass loss_fn= to Pipeline (loss_fn(outputs, "
        f"targets), or loss_fn(outputs) when the model computes its own loss){hint}"
    )


class Pipeline(nn.Module):
    """This rank's stage of a pipeline over ``layers``; ``step`` trains on one mini-batch.

    Args:
        layers: the whole model as an ``nn.Sequential`` or list of layers, identical on every
            rank. Build it on the meta device to allocate only this rank's layers: they are then
            initialized by ``reset_parameters`` from ``seed`` and the layer's index, so the
            weights do not depend on the number of stages.
        balance: layers per stage, one stage per process. ``None`` measures each layer's
            forward and backward time on ``sample`` and cuts where the slowest stage is
            fastest (``gpipe.planning.balancing.balance_by_time``, on the first rank, told
            to the others);
            without a sample, as even as possible by layer count.
        sample: one micro-batch of the model's input, for ``balance=None`` (one whole
            mini-batch for ``schedule="auto"``); read on the first rank only, so the others
            may pass None.
        chunks: micro-batches per mini-batch (default 1; a given ``Schedule``'s own count;
            under ``schedule="auto"``, None lets the search choose).
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` or ``"never"``; or
            ``gpipe.runtime.recompute.Layers(every=k)`` / ``Layers(select=...)`` to recompute some
            layers of every stage and keep the others' activations.
        schedule: the schedule's name (``"gpipe"``; ``gpipe.schedules.SCHEDULES`` lists them),
            or a ``Schedule`` for a fixed number of micro-batches, such as one read from a
            PyTorch schedule file by ``gpipe.schedules.from_csv``; or ``"auto"``: the
            schedule, its stages per process, ``chunks`` and ``balance`` that the simulator
            predicts fastest from the layers' times measured on ``sample``, among those the
            memory planner fits in ``memory_budget`` (``gpipe.planning.auto``), announced in
            one line with the runner-up; ``self.auto_choice`` holds it.
        loss_fn: ``loss_fn(output, target) -> scalar``, evaluated on the last stage.
        loss_reduction: ``"mean"`` if ``loss_fn`` averages over the batch (each micro-batch's
            loss is then weighted by its share of the rows), ``"sum"`` if it adds up.
        device: this rank's device (default: ``cuda:LOCAL_RANK`` if CUDA is available, else CPU).
        group: the process group of the pipeline's ranks (default: the whole world).
        tensor_parallel: T ranks per stage, each holding a part of its layers as ``tp_plan``
            splits them (DTensor styles of ``torch.distributed.tensor.parallel``), over a
            world of K x D x T processes, tensor innermost: rank = (position x D + replica)
            x T + tensor rank (``gpipe.parallel.tensor``). Their parameters and gradients
            are DTensors (``.full_tensor()`` gathers one); boundary tensors stay whole.
        tp_plan: module names of the whole model (``"3.mlp.fc"``; ``*`` for any one name)
            to ``"colwise"``, ``"rowwise"``, ``"sequence"`` or a ``ParallelStyle``; default:
            the plan the layers declare (``layer.tp_plan``: the built-in GPT's, or a Hugging
            Face model's ``base_model_tp_plan`` through ``gpipe.split``).
        loss_parallel: with ``tensor_parallel``, keep the logits of the last layer's
            vocabulary-split map split (a DTensor) and run ``loss_fn`` and the backward under
            ``torch.distributed.tensor.parallel.loss_parallel``, so that no rank holds the
            whole logits (a cross-entropy loss). The last stage's outputs are then DTensors;
            ``forward_only`` and ``generate`` gather the logits.
        data_parallel: D replicas of the pipeline side by side over a world of D x K
            processes (rank = position in the pipeline x D + replica: a stage's replicas are
            neighbours, on one machine where they fit); each trains on its own shard
            (``gpipe.parallel.replicas.shard``), gradients are summed across replicas in
            buckets while the last backward still runs, and ``step`` returns the loss of the
            union of the shards, weighted by rows.
        bucket_bytes: the size of those buckets; by default a quarter of the stage's gradients,
            between 1 MiB and 25 MiB (``gpipe.parallel.replicas.bucket_size``), so that most
            of them start before the last backward ends.
        shard: ``"full"`` splits each stage's parameters, gradients and optimizer state over
            its replicas with ``fully_shard`` (``gpipe.parallel.sharding.Sharding`` for its
            options); gradients are then DTensors (``.full_tensor()`` gathers one).
        deferred_batch_norm: replace every BatchNorm by
            ``gpipe.runtime.batchnorm.DeferredBatchNorm``,
            so running statistics are tracked once per mini-batch, from all its micro-batches.
        autocast: a dtype (``torch.bfloat16``, ``torch.float16``) each stage's forward and
            recomputation run under, as ``torch.autocast`` on this rank's device (a caller's
            ``torch.autocast`` around ``step`` works too, recomputation included).
        local_pipes: on CPU, exchange tensors with the processes of this machine through
            pipes rather than gloo's loopback TCP (far cheaper per message); gloo still
            carries collectives and the traffic with other machines.
        seed: seed of the initialization of layers built on the meta device.
        timeout: seconds any wait of a step (for a stage or a replica) may take before it
            raises StageError naming the stage.
        trace: record what this rank runs when, for ``timeline`` (``self.recorder``).
        memory_budget: bytes a process may hold, for ``schedule="auto"`` (default: the GPU's
            memory, or on CPU this machine's shared by its local processes).
        overlap_stages: on CUDA, issue the work of each of this rank's stages on a stream of
            its own, so that a forward of one stage and a backward of another (DualPipeV's
            pairs) run on the GPU at once (``gpipe.runtime.stage_streams``). ``None``: on
            for ``"dualpipe-v"`` on CUDA, off otherwise.
        compile: compile each layer (each child of ``layers``: a block, an embedding, a head)
            with ``torch.compile``, in place, so names and hooks stay; True for its defaults,
            or a dict of its keyword arguments (``{"backend": "aot_eager"}``). Works with every
            schedule and re-materialization; under a split backward (the zero-bubble family)
            the layers train eager, keeping the split, and run compiled in evaluation and
            forward passes (``gpipe.runtime.compiled`` says why); with ``seq_chunks``, each
            layer's cached forward, which sub-sequences run, is compiled too. Not with
            ``tensor_parallel`` or ``shard`` yet.
        seq_chunks: S > 1 cuts each micro-batch of a training step along its sequence into S
            sub-sequences that run through the pipeline one after the other (Seq1F1B); a
            stage keeps the keys and values of a micro-batch's earlier sub-sequences for the
            later ones, which attend to them, so it holds a sub-sequence's activations
            rather than a micro-batch's (``gpipe.runtime.seq_chunks``). For causal models
            whose layers carry keys and values: the built-in GPT, a Hugging Face causal LM
            cut by its plan. With ``"gpipe"``, ``"1f1b"``, ``"zero-bubble"`` and
            ``"zero-bubble-v"``; evaluation and forwards run whole sequences.
        seq_split: ``"even"`` (sub-sequences of equal length: S must divide the sequence) or
            ``"balanced"`` (of equal cost: later ones, attending to more tokens, are shorter).

    Layers may be ``gpipe.skip.skippable``: a skip that crosses stages is sent straight from
    the stage that stashes it to the stage that pops it, and its gradient comes back the same
    way. Layers of different stages may share a parameter (one ``nn.Parameter`` in both, as
    a tied embedding and output projection): each stage then holds a copy, and when
    ``step`` returns, every copy's gradient is the sum over all of them, so the optimizer
    keeps them equal (``self.ties`` lists them).

    Steps are run by ``self.runner``, a ``gpipe.engine.StepRunner``: its ``transport``,
    ``buckets`` and ``tied`` are the step's collaborators; ``self.sharded`` holds the stages
    sharded over their replicas under ``shard=``, else None.
    """

    def __init__(
        self,
        layers: nn.Sequential | Iterable[nn.Module],
        balance: list[int] | None = None,
        *,
        sample: Batch | None = None,
        chunks: int | None = None,
        checkpoint: str | Layers = "except_last",
        schedule: str | Schedule = "gpipe",
        loss_fn: LossFn | None = None,
        loss_reduction: str = "mean",
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        data_parallel: int = 1,
        tensor_parallel: int = 1,
        tp_plan: dict[str, PlanValue] | None = None,
        loss_parallel: bool = False,
        bucket_bytes: float | None = None,
        shard: str | Sharding | None = None,
        deferred_batch_norm: bool = False,
        autocast: torch.dtype | None = None,
        local_pipes: bool = True,
        seed: int = 0,
        timeout: float = 60.0,
        trace: bool = False,
        memory_budget: float | None = None,
        overlap_stages: bool | None = None,
        compile: bool | dict[str, Any] = False,
        seq_chunks: int = 1,
        seq_split: str = "even",
    ) -> None:
        super().__init__()
        config = PipelineConfig(
            balance=balance,
            chunks=chunks,
            checkpoint=checkpoint,
            schedule=schedule,
            loss_fn=loss_fn,
            loss_reduction=loss_reduction,
            device=device,
            data_parallel=data_parallel,
            tensor_parallel=tensor_parallel,
            tp_plan=tp_plan,
            loss_parallel=loss_parallel,
            bucket_bytes=bucket_bytes,
            shard=shard,
            deferred_batch_norm=deferred_batch_norm,
            autocast=autocast,
            local_pipes=local_pipes,
            seed=seed,
            timeout=timeout,
            trace=trace,
            memory_budget=memory_budget,
            overlap_stages=overlap_stages,
            compile=compile,
            seq_chunks=seq_chunks,
            seq_split=seq_split,
        )
        self._build(layers, config, sample, group)

    @classmethod
    def from_config(
        cls,
        layers: nn.Sequential | Iterable[nn.Module],
        config: PipelineConfig,
        *,
        sample: Batch | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> Pipeline:
        """The pipeline over ``layers`` that ``config`` describes, as ``Pipeline(layers,
        **config.options())`` builds it (``sample`` and ``group`` as ``Pipeline``'s), from
        the config as it was checked."""
        if not isinstance(config, PipelineConfig):
            raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
        pipe = cls.__new__(cls)
        nn.Module.__init__(pipe)
        pipe._build(layers, config, sample, group)
        return pipe

    def _build(
        self,
        layers: nn.Sequential | Iterable[nn.Module],
        config: PipelineConfig,
        sample: Batch | None,
        group: dist.ProcessGroup | None,
    ) -> None:
        """Build this rank's part as ``config`` says and hold it (collective)."""
        self.config = config
        self._hold(assemble(as_sequential(layers), config, sample=sample, group=group))

    def _hold(self, assembly: Assembly) -> None:
        """Register this rank's layers and keep what the build made, for the methods below."""
        for name, layer in assembly.built.layers.items():
            self.add_module(name, layer)
        config, cut, world = self.config, assembly.cut, assembly.world
        # the settings as they run: checked, or chosen by schedule="auto"
        self.checkpoint, self.loss_fn = config.checkpoint, config.loss_fn
        self.loss_reduction, self.timeout = config.loss_reduction, config.timeout
        self.local_pipes = config.local_pipes
        self.deferred_batch_norm = config.deferred_batch_norm
        self.device, self.autocast = assembly.device, assembly.settings.autocast
        self.tensor_parallel = assembly.settings.dims.tensor_parallel
        self.seq_chunks = assembly.settings.seq_chunks
        self.chunks, self.balance, self.auto_choice = cut.chunks, cut.balance, cut.auto_choice
        self.schedule_name, self.n_stages = cut.source.name, len(cut.balance)
        # where this rank sits, and its collaborators
        self.group, self.replicas, self.mesh = world.group, world.replicas, world.mesh
        self.rank, self.n_ranks = assembly.rank, assembly.n_ranks
        self.placement = assembly.placement
        self.stages, self.stage_index = self.placement.stages, self.placement.stages[0]
        built = assembly.built
        self.skip_layout, self.ties, self.sharded = built.skip_layout, built.ties, built.sharded
        self.precision, self.runner = assembly.precision, assembly.runner
        self.recorder = assembly.recorder
        self.last_step: StepTimes | None = None
        self.generation: Generation | None = None  # built by the first generate()

    # -- where the stages are ---------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.placement.is_first

    @property
    def is_last(self) -> bool:
        return self.placement.is_last

    def stage_of(self, layer: int) -> int:
        """The stage that holds layer ``layer`` of the whole model."""
        return self.placement.stage_of(layer)

    def rank_of(self, stage: int) -> int:
        """The rank (in the pipeline's group) that holds ``stage``."""
        return self.placement.rank_of(stage)

    def global_rank(self, rank: int) -> int:
        """The rank in the world of rank ``rank`` of this pipeline's group."""
        return self.placement.global_rank(rank)

    # -- schedules ----------------------------------------------------------------------------
    def schedule_for(self, n_microbatches: int) -> Schedule:
        """The schedule a step with ``n_microbatches`` micro-batches runs."""
        return self.runner.schedules.step(n_microbatches, self.training)

    # -- steps --------------------------------------------------------------------------------
    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        return_outputs: bool = False,
        counts: Any = None,
        microbatches: Sequence[tuple[Any, Any]] | None = None,
    ) -> Tensor | StepResult:
        """Forward and backward of one mini-batch; gradients accumulate in ``.grad``.

        ``inputs`` are read on the first stage and ``targets`` on the last (other ranks may
        pass None); either may be any payload (``gpipe.runtime.microbatch`` says which leaves
        are split). Without targets the last stage computes ``loss_fn(outputs)``.
        ``microbatches=[(inputs, targets), ...]`` runs your own micro-batches instead, in
        order, each of its own length and rows (``chunks`` unused): pass the same list on
        every rank of the pipeline (each replica its own). ``counts``
        (``loss_reduction="mean"``) weighs each row in the mean, such as by its valid tokens,
        which keeps the step exact when padding differs: one count per row, or one per token
        (rows x tokens, such as ``targets != -100``; what ``seq_chunks`` needs to weigh each
        sub-sequence). Returns the
        loss, the same on every rank; with ``return_outputs``, a ``StepResult`` that also
        holds the last stage's outputs (with ``microbatches=``, a list of each one's) and
        each micro-batch's loss. With a ``scaler``
        (float16) the loss is scaled on the last stage; then ``unscale_``, ``scaler.step``
        and ``scaler.update`` as usual.
        """
        _need_loss_fn(self.loss_fn, "step", return_outputs)
        given = given_microbatches(inputs, targets, microbatches)
        scale = self.precision.loss_scale(scaler)
        if self.mesh is not None and self.training:  # the T ranks of a stage drop out alike
            self.mesh.align_random_state(self.device)
        answer, self.last_step = self.runner.train(
            inputs,
            targets,
            scale=scale,
            counts=counts,
            keep_outputs=return_outputs,
            training=self.training,
            given=given,
        )
        return answer

    @torch.no_grad()
    def evaluate(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        return_outputs: bool = False,
        counts: Any = None,
        microbatches: Sequence[tuple[Any, Any]] | None = None,
    ) -> Tensor | StepResult:
        """The mini-batch loss without gradients or kept activations, on every rank (with
        ``return_outputs``, a ``StepResult``; ``microbatches=``, as ``step``'s)."""
        _need_loss_fn(self.loss_fn, "evaluate", return_outputs)
        return self.runner.evaluate(
            inputs,
            targets,
            counts=counts,
            keep_outputs=return_outputs,
            training=self.training,
            given=given_microbatches(inputs, targets, microbatches),
        )

    @torch.no_grad()
    def forward(self, inputs: Any = None) -> Any:
        """Inference over micro-batches; the output on the last stage, None elsewhere."""
        return self.runner.forward(inputs, self.training)

    def forward_only(
        self,
        inputs: Any = None,
        targets: Tensor | None = None,
        *,
        microbatches: Sequence[tuple[Any, Tensor]] | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> Tensor | list[Tensor] | None:
        """Log-probabilities of ``targets`` from a forward alone, on the last stage (None
        elsewhere); ``gpipe.engine.forward_only.forward_logprobs`` says what it takes."""
        return forward_logprobs(
            self.runner,
            inputs,
            targets,
            training=self.training,
            microbatches=microbatches,
            ignore_index=ignore_index,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | None,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        seed: int | None = None,
        in_flight: int | None = None,
        prefill_chunk: int | None = None,
    ) -> list[list[int]]:
        """The new tokens of each prompt (lists of token ids, read on the first stage), on
        every rank; collective, like ``step``. ``in_flight`` groups of sequences (default: one
        per stage) circulate, each with its own KV cache on every stage; prompts are
        prefilled in chunks of ``prefill_chunk`` tokens between decoding steps; a sequence
        ends after ``max_new_tokens`` or at ``eos_token_id``. ``temperature`` 0 is greedy;
        otherwise tokens are drawn (``top_k``, ``top_p``) with a generator per sequence
        seeded from ``seed`` and its index, so the same seed gives the same tokens whatever
        ``in_flight`` and the number of stages (``gpipe.engine.generation``; docs/generation.md).
        The layers run in eval mode, without gradients; no ``loss_fn`` is needed."""
        if seed is None and self.mesh is not None:  # the T ranks of a stage sample alike
            seed = self.mesh.first_tensor_ranks(random.SystemRandom().randrange(2**63))
        return self.generator().generate(
            prompts,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            seed=seed,
            in_flight=in_flight,
            prefill_chunk=prefill_chunk,
        )

    def generator(self) -> Generation:
        """What ``generate`` runs on this rank (``gpipe.engine.generation.Generation``), built
        on the first call: collective, since every stage is checked to keep a cache and the
        channel from the last stage back to the first is opened."""
        if self.sharded is not None:
            raise GenerationRefused(
                "generate() cannot run stages sharded over their replicas (shard=)"
            )
        if self.generation is None:
            self.generation = Generation(
                self.placement,
                self.runner.stages,
                self.device,
                autocast=self.autocast,
                timeout=self.timeout,
                local_pipes=self.local_pipes,
            )
        return self.generation

    def timeline(self) -> list[Event]:
        """What every rank ran in the last ``step``, ``evaluate`` or forward, merged; collective
        (every rank of the pipeline calls it, and each gets the whole timeline)."""
        if self.recorder is None:
            raise RuntimeError("timeline() needs a recording; pass trace=True to Pipeline")
        gathered: list[list[Event] | None] = [None] * self.n_ranks
        dist.all_gather_object(gathered, self.recorder.events(), group=self.group)
        return merge([events or [] for events in gathered])

    # -- gradients ----------------------------------------------------------------------------
    def unscale_(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
        """``scaler.unscale_(optimizer)`` with the found-inf flag reduced over every stage and
        replica, so that every rank's ``scaler.step`` steps or skips alike; returns whether
        it will skip. Once per step, after ``step`` and before clipping."""
        return self.precision.unscale_(scaler, optimizer)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        parameters: Iterable[nn.Parameter] | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> Tensor:
        """Clip the gradients of all stages by their global norm; returns that norm.

        ``parameters`` (default: all of this rank's, a parameter that stages share counted
        once) are those counted in the norm; when you pass them, leave out the copies of a
        weight tied by hand to another stage's so that it counts once. Every gradient of
        this rank is scaled. With a ``scaler`` (and its ``optimizer``) the gradients are
        unscaled first, if ``unscale_`` has not done it yet this step.
        """
        self.precision.unscale_once(scaler, optimizer)
        named = dict(self.named_parameters())
        counted = counted_once(self.ties, named) if parameters is None else parameters
        return clip_grad_norm_(
            counted,
            self.parameters(),
            max_norm,
            norm_type,
            device=self.device,
            group=self.group,
            timeout=self.timeout,
            stage=self.stage_index,
        )

    def extra_repr(self) -> str:
        where = f"stages={list(self.stages)} of {self.n_stages}, balance={self.balance}"
        how = f"chunks={self.chunks}, checkpoint={self.checkpoint!r}"
        return f"{where}, {how}, schedule={self.schedule_name!r}, device={self.device}"
