"""One rank's part of a training run: its stage, optimizer and data, stepped to the end."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.process_group import rank_device
from gpipe.models.gpt import tied_weights
from gpipe.parallel.ties import Tie, TiedGradients, counted, declared_ties
from gpipe.pipeline import Pipeline
from gpipe.planning.auto import AUTO
from gpipe.splitting import SplitModel
from gpipe.training.balance_choice import choose_balance, held_choice, sample_tokens
from gpipe.training.checkpoints.format import (
    load_checkpoint,
    read_run_record,
)
from gpipe.training.checkpoints.resuming import resume_point, trim_metrics
from gpipe.training.checkpoints.retention import Retention
from gpipe.training.checkpoints.writer import CheckpointWriter
from gpipe.training.data.run_data import check_same_data, run_dataset, run_documents
from gpipe.training.data.step_batches import PackedBatches, WindowBatches
from gpipe.training.data.tokenizer import ByteTokenizer, IdTokenizer, load_tokenizer
from gpipe.training.elastic import join_process_group, kill_point, restart_count
from gpipe.training.models.sources import model_from_dict, model_loss
from gpipe.training.optimization import build_optimizer, learning_rate
from gpipe.training.options import PRECISIONS, RunSpec, TrainOptions
from gpipe.training.reporting import Reporter, peak_memory
from gpipe.training.sample_text import generate_text
from gpipe.training.timelines import write_timeline

__all__ = ["StageRun", "run_stage"]


def run_stage(spec: RunSpec) -> dict[str, Any] | None:
    """Train this rank's stage (what every rank of ``gpipe train`` runs); returns the run's
    summary on rank 0 and None elsewhere."""
    return StageRun(spec).run()


class StageRun:
    """This rank's share of the job, from joining the process group to the run's summary.

    Every rank draws the same batches from the same seeded sampler; the first stage feeds
    the inputs and the last the targets. Rank 0 reports, logs and returns the summary."""

    def __init__(self, spec: RunSpec) -> None:
        opts = self.opts = TrainOptions(**spec.train)
        self.model = model_from_dict(spec.model)
        self.out = Path(spec.out)
        self.seq_len = opts.seq_len or self.model.seq_len
        self.device = rank_device(opts.device)
        join_process_group(self.device, opts.timeout)  # before anything else starts one
        self.resumed = spec.resume
        self.restarted = spec.restarted or restart_count() > 0
        self.checkpoint = resume_point(self.out, spec.resume, self.restarted, spec.checkpoint)
        saved = read_run_record(self.checkpoint) if self.checkpoint else {}
        if saved.get("model", {}).get("split_at") is not None:  # cut where it was cut before
            self.model.split_at = saved["model"]["split_at"]
        torch.manual_seed(opts.seed)
        layers = self.model.layers(self.opts.parts, opts.seed, opts.balance)
        self.pipe = self._build_pipeline(layers, saved)
        self.model.load_weights(layers, self.pipe)
        self.replica = self.pipe.replicas.replica if self.pipe.replicas is not None else 0
        self.world, self.me = dist.get_world_size(), dist.get_rank()
        self.root = self.me == 0
        self.ties, self.tied = self._tied_copies(layers)
        self.optimizer = build_optimizer(self.pipe, opts)
        # float16 needs its loss scaled; bfloat16 has float32's range and needs none
        fp16 = opts.precision == "fp16"
        self.scaler = torch.amp.GradScaler(self.device.type) if fp16 else None
        self.batches = self._batches()
        check_same_data(self.dataset, self.pipe)
        token_file = opts.tokenizer is None and self.dataset.vocab_bound is None
        self.tokenizer = IdTokenizer() if token_file else load_tokenizer(opts.tokenizer)
        self.tokens_trained = 0
        self.writer = CheckpointWriter(
            self.out / "checkpoints",
            self.pipe,
            retention=Retention(opts.keep, opts.keep_every),
            background=not opts.sync_save,
            process={"auto": None, "process": True, "thread": False}[opts.save_writer],
        )
        self.step = 0
        self.train_loss = self.val_loss = float("nan")

    def _build_pipeline(self, layers: nn.Sequential, saved: dict[str, Any]) -> Pipeline:
        """This rank's stage; a resumed run keeps the balance its checkpoint was trained with
        (and under ``--schedule auto``, the choice); a new one under auto chooses here, and
        its options record the choice. A split model is already cut, one stage a part."""
        opts = self.opts = held_choice(self.opts, saved)
        if isinstance(layers, SplitModel):
            return self._pipeline(layers, [1] * len(layers))
        if opts.schedule == AUTO:
            sample = sample_tokens(opts, self.model.vocab_size, self.seq_len, None)
            pipe = self._pipeline(layers, None, sample=sample)
            assert pipe.auto_choice is not None  # schedule="auto" makes one
            chosen = pipe.auto_choice.chosen
            self.opts = replace(
                opts,
                schedule=chosen.schedule,
                chunks=chosen.chunks,
                virtual_stages=chosen.virtual_stages,
            )
            return pipe
        measured = saved.get("balance")
        cut = choose_balance(
            opts, layers, self.model.vocab_size, self.seq_len, self.device, measured
        )
        return self._pipeline(layers, cut)

    def _pipeline(self, layers: nn.Sequential, balance: list[int] | None, **more: Any) -> Pipeline:
        opts = self.opts
        return Pipeline(
            layers,
            balance,
            chunks=opts.chunks,
            checkpoint=opts.checkpoint,
            schedule=opts.schedule,
            loss_fn=model_loss,
            device=self.device,
            data_parallel=opts.data_parallel,
            tensor_parallel=opts.tensor_parallel,
            shard=None if opts.shard == "none" else opts.shard,
            autocast=PRECISIONS[opts.precision],
            seed=opts.seed,
            timeout=opts.timeout,
            trace=opts.trace,
            compile={"backend": opts.compile_backend} if opts.compile else False,
            seq_chunks=opts.seq_chunks,
            seq_split=opts.seq_split,
            **more,
        )

    def _batches(self) -> WindowBatches | PackedBatches:
        """Where each step's data comes from: windows of the token stream, or packed
        documents under ``--pack``."""
        opts = self.opts
        shape = (opts.batch_size, self.seq_len, opts.chunks or 1)
        where = {"seed": opts.seed, "replica": self.replica, "replicas": opts.data_parallel}
        if opts.pack:
            self.dataset, train, val = run_documents(opts, self.out)
            return PackedBatches(train, val, *shape, **where)
        self.dataset = run_dataset(opts, self.out)
        return WindowBatches(self.dataset, *shape, **where)

    def run(self) -> dict[str, Any] | None:
        """Train to the last step; returns the run's summary on rank 0 and None elsewhere."""
        self.restore()
        reporter = Reporter(self.opts, self.out, self.step, enabled=self.root)
        started = time.perf_counter()
        try:
            while self.step < self.opts.steps:
                self._step_and_report(reporter)
            elapsed = time.perf_counter() - started
            self.save()
            self.writer.close()
        except BaseException:
            self.writer.abandon()
            raise
        finally:
            reporter.close()
        return self._summary(elapsed)

    def restore(self) -> None:
        """Continue from the checkpoint, if there is one: weights, optimizer, sampler, step
        and loss scale; rank 0 cuts the metrics log back to the step continued from."""
        if self.checkpoint is not None:
            held = {"sampler": self.batches.state_dict(), "step": 0}
            if self.scaler is not None:
                held["scaler"] = self.scaler.state_dict()
            restored = load_checkpoint(
                self.checkpoint, self.pipe, self.optimizer, held, group=self.pipe.group
            )
            try:
                self._continue_from(restored)
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                raise ValueError(
                    f"{self.checkpoint}: its saved state is not what gpipe saves ({exc})"
                ) from None
        if self.root and (self.resumed or self.restarted):
            trim_metrics(self.out / "metrics.jsonl", self.step)
            how = "restarted" if self.restarted else "resumed"
            where = (
                f"from {self.checkpoint}"
                if self.checkpoint
                else "with no checkpoint to continue from"
            )
            stages = self.pipe.balance
            print(f"{how} {where}: training from step {self.step}, stages {stages}", flush=True)

    def _continue_from(self, restored: dict[str, Any]) -> None:
        """The sampler, step and loss scale of a checkpoint's state, as loaded."""
        step = restored["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"its step is {step!r}")
        self.batches.load_state_dict(restored["sampler"])
        self.step = step
        if self.scaler is not None:
            self.scaler.load_state_dict(restored["scaler"])

    def _step_and_report(self, reporter: Reporter) -> None:
        """One training step, then what is due after it: evaluation, the log line, a save."""
        opts = self.opts
        record = self._train_step()
        if self.step % opts.eval_every == 0 or self.step == opts.steps:
            self.val_loss = record["val_loss"] = self.evaluate()
        reporter.step(record)
        if opts.save_every and self.step % opts.save_every == 0 and self.step != opts.steps:
            self.save()

    def _train_step(self) -> dict[str, Any]:
        """Train on the next mini-batch; returns the step's metrics."""
        opts, pipe = self.opts, self.pipe
        kill_point("step", self.step + 1)  # tests only: GPIPE_TEST_KILL loses this process
        # Dropout draws from a seed of the step, so a resumed run draws the same masks; the
        # tensor ranks of a stage draw alike, as their copies of the activations must stay equal.
        pipelines, me = self.world // opts.tensor_parallel, self.me // opts.tensor_parallel
        torch.manual_seed(opts.seed * 1_000_003 + self.step * pipelines + me)
        lr = learning_rate(self.step, opts)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.batches.next(pipe)
        tick = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = cast(Tensor, pipe.step(**batch.args, scaler=self.scaler))  # not return_outputs
        norm = self._apply_gradients()
        seconds = time.perf_counter() - tick
        self.step += 1
        self.tokens_trained += batch.tokens
        bubble = self._measured_bubble()
        self.train_loss = float(loss)
        if opts.trace and self.step == opts.steps:  # collective, before evaluate() records
            events = pipe.timeline()
            if self.root:
                write_timeline(self.out, events, pipe, batch.microbatches)
        return {
            "step": self.step,
            "loss": self.train_loss,
            "lr": lr,
            "grad_norm": float(norm),
            "seconds": seconds,
            "tokens_per_s": batch.tokens / seconds,
            "bubble": bubble,
        }

    def _tied_copies(self, layers: nn.Sequential) -> tuple[list[Tie], TiedGradients]:
        """The GPT's tied embedding and head: copies that start equal, whose gradients are
        summed before every optimizer step (over the ranks that hold them, within the
        pipeline's timeout), so that they stay equal."""
        pipe = self.pipe
        names = [(f"{e}.{a}", f"{h}.{b}") for e, a, h, b in tied_weights(layers)]
        ties = declared_ties(layers, pipe.balance, names)
        params = dict(pipe.named_parameters())
        tied = TiedGradients(
            ties,
            params,
            pipe.stages,
            pipe.rank_of,
            pipe.global_rank,
            pipe.timeout,
            pipeline_group=pipe.group if pipe.mesh is not None else None,
        )
        return ties, tied

    def _apply_gradients(self) -> torch.Tensor:
        """Sum the tied copies' gradients, clip, and step; returns the gradient norm (each
        tie counted once: the GPT's declared ones, and a weight the model's layers share,
        such as a Hugging Face model's tied embedding and head, which the pipeline found)."""
        self.tied.sum()
        ties = [*self.pipe.ties, *self.ties]
        norm = self.pipe.clip_grad_norm_(
            self.opts.grad_clip,
            parameters=counted(ties, dict(self.pipe.named_parameters())),
            scaler=self.scaler,
            optimizer=self.optimizer,
        )
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped, on every rank alike, if one overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        return norm

    def _measured_bubble(self) -> float:
        """The share of the last step that the ranks together spent not computing."""
        last = self.pipe.last_step
        assert last is not None
        times = torch.tensor([last.busy, last.total], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(times)
        return float(1 - times[0] / times[1])

    def evaluate(self) -> float:
        """The mean loss over the first ``eval_batches`` batches of the held-out text."""
        opts, pipe = self.opts, self.pipe
        pipe.eval()
        batches = self.batches.validation(pipe, opts.eval_batches, opts.seed + 1)
        # without return_outputs, evaluate gives the loss alone
        losses = [float(cast(Tensor, pipe.evaluate(**batch.args))) for batch in batches]
        pipe.train()
        return sum(losses) / len(losses)

    def save(self) -> None:
        """Once per stage: the replicas hold the same weights and optimizer state (their
        gradients are summed, their BatchNorm statistics merged), so replica 0 writes (each
        of its tensor ranks its shards), in the background unless ``--sync-save``."""
        description = {
            "model": self.model.to_dict(),
            "train": asdict(self.opts),
            "stages": self.pipe.n_ranks,
            "data_parallel": self.opts.data_parallel,
            "tensor_parallel": self.opts.tensor_parallel,
            "balance": self.pipe.balance,
        }
        extra: dict[str, Any] = {"sampler": self.batches.state_dict(), "step": self.step}
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        step = self.step
        self.writer.save(
            step,
            self.pipe,
            self.optimizer,
            extra,
            description,
            on_written=lambda: kill_point("save", step),
        )

    def _prompt(self) -> list[int]:
        """The sample's first ids: ``--prompt``, or where the model's vocabulary cannot say
        it (a token file's ids), the validation data's first few."""
        ids = self.tokenizer.encode(self.opts.prompt)
        if ids and max(ids) < self.model.vocab_size:
            return ids
        return [int(i) for i in self.dataset.val[:4]]

    def _summary(self, elapsed: float) -> dict[str, Any] | None:
        """The sample text and every rank's peak memory, with the run's losses and speed."""
        opts = self.opts
        sample = ""  # --sample-tokens 0: no sample
        if opts.sample_tokens > 0:
            sample = generate_text(
                self.pipe,
                self._prompt(),
                opts.sample_tokens,
                self.seq_len,
                opts.seed,
                self.device,
                self.tokenizer,
                self.model.inputs,
            )
        memory: list[int] = [0] * self.world
        if self.world > 1:
            dist.all_gather_object(memory, peak_memory(self.device))
        else:
            memory = [peak_memory(self.device)]
        if not self.root:
            return None
        return {
            "steps": self.step,
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            "seconds": elapsed,
            "tokens_per_s": self.tokens_trained / elapsed if elapsed > 0 else 0.0,
            "peak_memory_bytes": memory,
            "sample": sample,
            "balance": self.pipe.balance,
            "unit": "byte" if isinstance(self.tokenizer, ByteTokenizer) else "token",
        }
