"""PipelineStrategy: PyTorch Lightning trains a LightningModule's network through gpipe's
``Pipeline``, one stage per process, with the module's own ``training_step`` and
``validation_step`` left as they were written for one device.

The contract (docs/integrations.md, "PyTorch Lightning"): the module holds its network as an
``nn.Sequential`` attribute and a loss over (outputs, targets), and its batches are
(inputs, targets). At set-up the strategy cuts the network and puts this rank's stage (a
``gpipe.Pipeline``) in its place, so ``configure_optimizers`` sees this stage's parameters and
the module's state dict reads like the original's. While a step runs, calling the network
runs the pipeline on the whole batch and gives every rank the outputs of the last stage, so
what the step computes from them and logs is the same on every rank; the loss it returns is
replaced by the pipelined step's, whose backward has already run.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import RandomSampler

from gpipe.comm.payload import decode, encode
from gpipe.engine import ScheduleSource, StepResult
from gpipe.pipeline import Pipeline
from gpipe.runtime.microbatch import check_chunks
from gpipe.runtime.partitions import balance_counts
from gpipe.runtime.recompute import check_checkpoint
from gpipe.runtime.stage import LossFn
from gpipe.schedules import Schedule

__all__ = ["PipelineStrategy"]

# Pipeline's arguments that the strategy sets itself (beside its own named arguments).
_SET_BY_STRATEGY = ("layers", "device", "group")
# Dimensions beside the pipeline that the strategy does not lay out yet: one pipeline spans
# every process.
_NOT_SUPPORTED = ("data_parallel", "shard", "bucket_bytes")
# The checkpoint's key for the optimizer states of every rank.
_RANKS_KEY = "gpipe_pipeline_ranks"


class _Network(nn.Module):
    """What the module's network attribute holds while a step runs: calling it runs the
    pipeline on the whole batch and returns the last stage's outputs, on every rank."""

    def __init__(self, run: Callable[[Any], Any]) -> None:
        super().__init__()
        self.run = run
        self.calls = 0

    def forward(self, *inputs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                "the step called the network twice: under PipelineStrategy each call runs the "
                "whole pipeline on the batch, so call it once per step"
            )
        return self.run(inputs[0] if len(inputs) == 1 else inputs)


def _with_loss(output: STEP_OUTPUT, loss: Tensor) -> STEP_OUTPUT:
    """``training_step``'s output with its loss replaced by ``loss``, in the dtype of the loss
    the step computed (the pipeline sums its micro-batches' losses in float64)."""
    given = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(given, Tensor) and given.is_floating_point():
        loss = loss.to(given.dtype)
    if isinstance(output, Tensor):
        return loss
    if isinstance(output, Mapping) and "loss" in output:
        return {**output, "loss": loss}
    return output  # None, or no loss: Lightning says what it expects


class PipelineStrategy(DDPStrategy):
    """Train a LightningModule's ``nn.Sequential`` network as a pipeline over the Trainer's
    processes, one stage each: ``Trainer(strategy=PipelineStrategy(chunks=4), devices=K)``.

    A step is exact: gradients of all micro-batches accumulate, so an optimizer step equals
    one un-pipelined step on the whole batch. Every process sees every batch (the stages of
    one pipeline take the same batches).

    Args:
        chunks: micro-batches per batch.
        schedule: the schedule's name (``gpipe.schedules.SCHEDULES``) or a ``Schedule``.
        network: the name of the module's attribute that holds the network, an
            ``nn.Sequential`` (for a model that is not one, assign ``gpipe.split(model, ...)``
            to it); default: the module's one ``nn.Sequential`` attribute.
        loss_fn: ``loss_fn(outputs, targets)``, the mean loss of a micro-batch, which the last
            stage computes; default: the module's ``loss_fn`` attribute or method.
        targets: the targets of a batch (``targets(batch)``); default: ``batch[1]`` of a batch
            that is a pair (inputs, targets).
        balance: layers per stage (default: as even as possible by layer count).
        checkpoint: re-materialization, as ``gpipe.Pipeline``'s.
        seed: the seed of layers built on the meta device (in ``configure_model``).
        timeout: seconds any wait of a pipelined step may take before it fails.
        process_group_backend: ``"gloo"`` or ``"nccl"`` (default: NCCL on GPUs, else gloo).
        start_method: how Lightning starts the processes, as ``DDPStrategy``'s.
        **pipeline_options: any other argument of ``gpipe.Pipeline``, such as
            ``deferred_batch_norm=True`` or ``local_pipes=False``.
    """

    def __init__(
        self,
        chunks: int = 1,
        schedule: str | Schedule = "gpipe",
        *,
        network: str | None = None,
        loss_fn: LossFn | None = None,
        targets: Callable[[Any], Any] | None = None,
        balance: list[int] | None = None,
        checkpoint: str = "except_last",
        seed: int = 0,
        timeout: float = 60.0,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **pipeline_options: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, start_method=start_method)
        self.chunks = check_chunks(chunks)
        if schedule != "auto":  # an unknown name is refused here, not in the processes
            ScheduleSource.of(schedule)
        self.schedule = schedule
        check_checkpoint(checkpoint)
        self.checkpoint = checkpoint
        for name, value in (("loss_fn", loss_fn), ("targets", targets)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        if network is not None and not isinstance(network, str):
            raise TypeError(f"network must be an attribute's name, got {type(network).__name__}")
        _check_options(pipeline_options)
        self.network, self.loss_fn, self.targets = network, loss_fn, targets
        if balance is not None:
            balance = balance_counts(balance)  # its sum is the network's to check, in setup
        self.balance, self.seed, self.step_timeout = balance, seed, timeout
        self.pipeline_options = dict(pipeline_options)
        self.pipeline: Pipeline | None = None
        self._network_name = ""
        self._key_order: list[str] = []
        self._fresh_grads: list[tuple[nn.Parameter, Tensor]] = []
        self._checked_loss = False
        self._built_on_meta = False

    # -- set-up ---------------------------------------------------------------------------
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica: every stage takes every batch, in the same order."""
        return {"num_replicas": 1, "rank": 0}

    def setup(self, trainer: Trainer) -> None:
        """Cut the network and keep this rank's stage in its place, then the optimizers over
        the module's (now this stage's) parameters."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self._module()
        self._refuse_what_cannot_be_honoured(module)
        callbacks = getattr(trainer, "callbacks", [])  # set by the Trainer's connector
        if any(isinstance(c, StochasticWeightAveraging) for c in callbacks):
            raise ValueError(
                "StochasticWeightAveraging is not honoured by PipelineStrategy: it averages a "
                "copy of the whole module, and each rank holds only its stage"
            )
        # Lightning gives the training loader of every DDPStrategy a shuffling
        # DistributedSampler, even a sequential one, and offers a strategy no public way to
        # decline: the stages of one pipeline are one replica and take the loaders as written.
        trainer._accelerator_connector.use_distributed_sampler = False
        name = self._find_network(module)
        held = getattr(module, name)
        if isinstance(held, Pipeline):  # cut by an earlier run, of this strategy or another
            self._adopt(held, name)
        else:
            self.pipeline = self._build(module, name)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def process_dataloader(self, dataloader: object) -> object:
        """Every stage takes the same batches: a shuffling sampler without a generator of its
        own (which would draw its order from each process's global RNG, and dropout on one
        stage and not another makes those differ) gets one, seeded alike on every rank."""
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            sampler.generator = torch.Generator().manual_seed(self.broadcast(seed))
        return dataloader

    def _refuse_what_cannot_be_honoured(self, module: LightningModule) -> None:
        if not module.automatic_optimization:
            raise ValueError(
                "PipelineStrategy needs automatic optimization: the module sets "
                "automatic_optimization=False, and the pipeline runs forward and backward "
                "together in one step, which manual_backward cannot split"
            )
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise ValueError(
                f"Trainer(precision={plugin.precision!r}) scales the loss outside the pipeline; "
                "PipelineStrategy takes '32-true', '64-true', 'bf16-mixed', 'bf16-true' or "
                "'16-true'"
            )
        if type(plugin) not in (Precision, DoublePrecision, HalfPrecision, MixedPrecision):
            raise ValueError(
                f"the precision plugin {type(plugin).__name__} is not one PipelineStrategy "
                "takes: Trainer(precision='32-true', '64-true', 'bf16-mixed', 'bf16-true' or "
                "'16-true')"
            )
        # Lightning passes Trainer(sync_batchnorm=True) only to the strategy's _layer_sync.
        if self._layer_sync is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) is not honoured by PipelineStrategy: pass "
                "PipelineStrategy(deferred_batch_norm=True) for BatchNorm over whole batches"
            )

    def _find_network(self, module: LightningModule) -> str:
        """The name of the module's attribute that holds the network."""
        if self.network is None:
            found = [n for n, child in module.named_children() if isinstance(child, nn.Sequential)]
            found += [n for n, c in module.named_children() if isinstance(c, Pipeline)]
            if len(found) != 1:
                raise ValueError(
                    "PipelineStrategy pipelines the module's nn.Sequential; "
                    f"{type(module).__name__} has {len(found)} ({', '.join(found) or 'none'}): "
                    "pass PipelineStrategy(network='<attribute>')"
                )
            return found[0]
        held = getattr(module, self.network, None)
        if not isinstance(held, (nn.Sequential, Pipeline)):
            raise TypeError(
                f"network={self.network!r}: {type(module).__name__}.{self.network} is "
                f"{type(held).__name__}, expected an nn.Sequential (cut another model with "
                "gpipe.split and assign the result)"
            )
        return self.network

    def _loss(self, module: LightningModule) -> LossFn:
        if self.loss_fn is not None:
            return self.loss_fn
        found = getattr(module, "loss_fn", None)
        if not callable(found):
            raise ValueError(
                "PipelineStrategy needs the loss its last stage computes on each micro-batch: "
                f"pass loss_fn=... or give {type(module).__name__} a loss_fn(outputs, targets) "
                "method or attribute"
            )
        return found

    def _adopt(self, pipe: Pipeline, name: str) -> None:
        """Go on with the pipeline an earlier run left in the module (a second Trainer's
        ``test`` or ``fit`` after the first's), which must be cut as this strategy would."""
        if pipe is not self.pipeline:
            asked = (self.chunks, self.schedule if isinstance(self.schedule, str) else None)
            held = (pipe.chunks, pipe.schedule_name if isinstance(self.schedule, str) else None)
            if asked != held:
                raise ValueError(
                    f"the module's {name!r} was pipelined by an earlier run with chunks="
                    f"{pipe.chunks}, schedule={pipe.schedule_name!r}; this PipelineStrategy "
                    f"asks chunks={self.chunks}, schedule={self.schedule!r}: pass the same"
                )
        self.pipeline = pipe
        self._network_name = name

    def _build(self, module: LightningModule, name: str) -> Pipeline:
        """This rank's stage of the network, in its place in ``module``."""
        layers = getattr(module, name)
        inside = {id(p) for p in layers.parameters()}
        outside = [n for n, p in module.named_parameters() if id(p) not in inside]
        if outside:
            raise ValueError(
                f"PipelineStrategy trains the network {name!r} alone; {type(module).__name__} "
                f"has parameters outside it, which no stage would train: {outside}"
            )
        self.precision_plugin.convert_module(module)
        self._key_order = list(module.state_dict())
        pipe = Pipeline(
            layers,
            self.balance,
            chunks=self.chunks,
            schedule=self.schedule,
            checkpoint=self.checkpoint,
            loss_fn=self._loss(module),
            device=self.root_device,
            seed=self.seed,
            timeout=self.step_timeout,
            **self.pipeline_options,
        )
        setattr(module, name, pipe)
        self._network_name = name
        unbuilt = [n for n, t in module.state_dict().items() if t.is_meta]
        if unbuilt:
            raise ValueError(
                f"{type(module).__name__} holds tensors on the meta device outside the network "
                f"{name!r}, which the pipeline does not build: {unbuilt}"
            )
        return pipe

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """``configure_model`` builds on the meta device: each rank then allocates only its
        stage, initialized by ``reset_parameters`` from ``seed`` and the layer's index."""
        with torch.device("meta"):
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """A network built on the meta device takes its weights once its stage is built (asked
        before set-up and again after, when the stage no longer is on the meta device)."""
        module = self.lightning_module
        if self.pipeline is None and module is not None:
            self._built_on_meta = any(p.is_meta for p in module.parameters())
        return self._built_on_meta

    # -- steps ----------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's ``training_step``, where calling the network runs a pipelined step;
        returns its output with the loss replaced by the step's."""
        module = self._module()
        batch = args[0] if args else kwargs.get("batch")
        targets = self._targets_of(batch)
        losses: list[Tensor] = []
        run = self._network_runs(lambda inputs: self._train(inputs, targets, losses))
        with self.precision_plugin.train_step_context(), run:
            output = module.training_step(*args, **kwargs)
        if not losses:
            raise RuntimeError(
                f"{type(module).__name__}.training_step did not call self.{self._network_name}: "
                "PipelineStrategy runs the pipelined step when the step calls the network"
            )
        self._check_loss_once(output, losses[0])
        return _with_loss(output, losses[0])

    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context(), self._network_runs(self._forward):
            return self._module().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context(), self._network_runs(self._forward):
            return self._module().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), self._network_runs(self._forward):
            return self._module().predict_step(*args, **kwargs)

    @contextlib.contextmanager
    def _network_runs(self, run: Callable[[Any], Any]) -> Iterator[None]:
        """While the step runs, the network attribute is a ``_Network`` that calls ``run``."""
        module, pipe = self._module(), self._stage()
        setattr(module, self._network_name, _Network(run))
        try:
            yield
        finally:
            setattr(module, self._network_name, pipe)

    def _targets_of(self, batch: Any) -> Any:
        if self.targets is not None:
            return self.targets(batch)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[1]
        size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
        raise ValueError(
            f"PipelineStrategy takes a batch as a pair (inputs, targets), got a "
            f"{type(batch).__name__}{size}: pass PipelineStrategy(targets=lambda batch: ...)"
        )

    def _train(self, inputs: Any, targets: Any, losses: list[Tensor]) -> Any:
        """One pipelined step on the whole batch; its loss joins ``losses``. Its gradients
        are kept aside until ``backward``: Lightning zeroes the gradients between
        ``training_step`` and ``backward``."""
        pipe = self._stage()
        params = list(pipe.parameters())
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        result = pipe.step(inputs, targets, return_outputs=True)
        assert isinstance(result, StepResult)
        self._fresh_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, held, strict=True):
            p.grad = grad
        losses.append(result.loss)
        return self._shared(result.outputs)

    @torch.inference_mode(False)
    def _forward(self, inputs: Any) -> Any:
        # The pipeline keeps buffers between steps, which must not be inference tensors.
        with torch.no_grad():
            return self._shared(self._stage()(inputs))

    def _shared(self, outputs: Any) -> Any:
        """The last stage's ``outputs``, on every rank of the pipeline."""
        pipe = self._stage()
        if pipe.n_ranks == 1:
            return outputs
        source = pipe.global_rank(pipe.rank_of(pipe.n_stages - 1))
        header: list[Any] = [None]
        items: tuple[Tensor | None, ...] = ()
        if pipe.is_last:
            found, form, structure = encode(outputs)
            items = tuple(None if t is None else t.contiguous() for t in found)
            shapes = [None if t is None else (t.shape, t.dtype) for t in items]
            header = [(form, structure, shapes)]
        dist.broadcast_object_list(header, src=source, group=pipe.group)
        form, structure, shapes = header[0]
        if not pipe.is_last:
            items = tuple(
                None if s is None else torch.empty(s[0], dtype=s[1], device=pipe.device)
                for s in shapes
            )
        for tensor in items:
            if tensor is not None:
                dist.broadcast(tensor, src=source, group=pipe.group)
        return decode(items, form, structure)

    def _check_loss_once(self, output: STEP_OUTPUT, loss: Tensor) -> None:
        """Warn if the loss training_step computed is not the pipeline's: the pipeline
        trains on ``loss_fn``, whatever the step computes."""
        if self._checked_loss:
            return
        self._checked_loss = True
        given = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(given, Tensor) or given.numel() != 1:
            return
        mine, theirs = float(given), float(loss)
        if not math.isclose(mine, theirs, rel_tol=1e-3, abs_tol=1e-6):
            rank_zero_warn(
                f"training_step returned a loss of {mine:.6g} and the pipelined step's loss_fn "
                f"gave {theirs:.6g}: the pipeline trains on loss_fn, so make training_step's "
                "loss loss_fn(network outputs, targets)"
            )

    # -- backward, optimizer step ---------------------------------------------------------
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The step's backward already ran: its gradients join ``.grad`` here, divided by
        ``accumulate_grad_batches`` as Lightning divides the loss; the hooks around it run."""
        module = self._module()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        share = 1.0 / module.trainer.accumulate_grad_batches
        for param, grad in self._fresh_grads:
            if share != 1.0:
                grad.mul_(share)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self._fresh_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's step, with ``Trainer(gradient_clip_val=...)`` by norm over all stages.

        Clipped here by the global norm, the gradients leave Lightning's own clipping (by this
        stage's norm, which is no larger) nothing to do."""

        def step_then_clip() -> Any:
            result = closure()
            trainer = self._module().trainer
            value, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
            if value and (algorithm is None or algorithm == "norm"):
                self._stage().clip_grad_norm_(float(value))
            return result

        return super().optimizer_step(optimizer, step_then_clip, model, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole module's state on rank 0, every stage's gathered there (on CPU, under the
        names of the module on one device); this rank's own elsewhere. Collective."""
        own: dict[str, Any] = move_data_to_device(dict(self._module().state_dict()), "cpu")
        gathered = self._gathered(own)
        if gathered is None:
            return own
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part)
        order = [k for k in self._key_order if k in merged]
        order += [k for k in merged if k not in set(order)]
        return {k: merged[k] for k in order}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every rank's optimizer state, on rank 0 (each optimizes its own stage's parameters);
        this rank's own elsewhere. Collective."""
        own: dict[str, Any] = move_data_to_device(super().optimizer_state(optimizer), "cpu")
        gathered = self._gathered(own)
        if gathered is None:
            return own
        return {_RANKS_KEY: gathered, "balance": list(self._stage().balance)}

    def _gathered(self, own: dict[str, Any]) -> list[dict[str, Any]] | None:
        """``own`` of every rank, in rank order, on rank 0; None elsewhere (and before the
        network is cut)."""
        if self.pipeline is None:
            return None
        if self.world_size == 1:
            return [own]
        parts: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(own, parts, dst=0)
        return parts

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The whole module's state: before the network is cut, all of it; after, the keys
        this rank holds (the other stages' are theirs)."""
        module = self._module()
        state = checkpoint["state_dict"]
        if self.pipeline is not None:
            own = set(module.state_dict())
            state = {k: v for k, v in state.items() if k in own}
        module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its own optimizer state, from a checkpoint of the same pipeline."""
        balance = list(self._stage().balance)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            ranks = state.get(_RANKS_KEY) if isinstance(state, Mapping) else None
            if ranks is None:
                raise ValueError(
                    "the checkpoint's optimizer state was saved without PipelineStrategy; "
                    "load its weights alone (Module.load_from_checkpoint) and start a new fit"
                )
            if len(ranks) != self.world_size or state["balance"] != balance:
                raise ValueError(
                    f"the checkpoint's optimizer states are of {len(ranks)} processes with "
                    f"balance {state['balance']}, this pipeline has {self.world_size} with "
                    f"balance {balance}: resume with the same devices and balance"
                )
            optimizer.load_state_dict(ranks[self.global_rank])

    # -- the parts ------------------------------------------------------------------------
    def _module(self) -> LightningModule:
        module = self.lightning_module
        assert module is not None, "the Trainer connects the module first"
        return module

    def _stage(self) -> Pipeline:
        assert self.pipeline is not None, "setup builds the pipeline first"
        return self.pipeline


def _check_options(options: Mapping[str, Any]) -> None:
    """Refuse a pipeline option that the strategy sets itself, lays out, or does not know."""
    known = set(inspect.signature(Pipeline).parameters)
    for name in options:
        if name in _NOT_SUPPORTED:
            raise ValueError(
                f"PipelineStrategy({name}=...) is not supported: one pipeline spans all of "
                "the Trainer's processes"
            )
        if name in _SET_BY_STRATEGY:
            raise ValueError(
                f"PipelineStrategy sets {name} itself; got {name}= among the pipeline options"
            )
        if name not in known:
            raise TypeError(
                f"PipelineStrategy got an unexpected argument {name!r}: it takes chunks, "
                "schedule, network, loss_fn, targets, balance, checkpoint, seed, timeout, "
                "process_group_backend, start_method and gpipe.Pipeline's other arguments"
            )
