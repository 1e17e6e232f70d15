"""The training job behind ``gpipe train``: what every rank runs, one stage per process.

Every rank draws the same batches from the same seeded sampler; the first stage feeds the
inputs and the last the targets. Embedding and LM head may be tied across the first and last
stage: the two copies start equal and their gradients are summed before every optimizer
step, so they stay equal, as one shared weight would.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe.errors import StageError
from gpipe.parallel.replicas import shard
from gpipe.pipeline import Pipeline, agreed_balance, init_process_group
from gpipe.planning.balancing import balance_by_params
from gpipe.planning.simulate import analytic_bubble, predict
from gpipe.runtime.microbatch import split_sizes
from gpipe.runtime.partitions import even_balance
from gpipe.runtime.timeline import Event, plot_gantt, to_chrome
from gpipe.training.checkpoints import (
    discard_partial,
    latest_checkpoint,
    load_checkpoint,
    read_description,
    save_checkpoint,
)
from gpipe.training.data import BatchSampler, ByteDataset, decode, encode, load_text, stdlib_corpus
from gpipe.training.elastic import join_process_group, kill_point, restart_count
from gpipe.training.models.gpt import GPTConfig, build_gpt, lm_loss, tied_weights
from gpipe.view import Measured
from gpipe.view import write as write_page

__all__ = ["TrainOptions", "RunSpec", "load_corpus", "run_stage"]


@dataclass
class TrainOptions:
    """How to train; the model's shape lives in GPTConfig."""

    stages: int = 2
    data_parallel: int = 1  # replicas of the pipeline; --batch-size is split among them
    chunks: int = 8
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    virtual_stages: int = 1  # stages per process, for the interleaved schedule
    balance: str = "time"  # time, params, even, or layers per stage such as "3,3"
    steps: int = 200
    batch_size: int = 32
    seq_len: int | None = None  # default: the model's maximum
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 50  # 0: only at the end; docs/train.md says why 50
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"  # fp32, bf16 (autocast) or fp16 (autocast and loss scaling)
    data: str | None = None
    timeout: float = 300.0
    sample_tokens: int = 300
    prompt: str = "def "
    quiet: bool = False
    trace: bool = False  # write the last step's timeline into the run folder


@dataclass
class RunSpec:
    """Everything a rank needs to run its stage; small and picklable for new processes."""

    model: dict[str, Any]
    train: dict[str, Any]
    out: str
    resume: bool = False  # continue from the newest checkpoint that verifies; one must
    restarted: bool = False  # the job was here before: continue from one if any verifies
    extra: dict[str, Any] = field(default_factory=dict)


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_corpus(path: str | None) -> bytes:
    return stdlib_corpus() if path is None else load_text(path)


def learning_rate(step: int, opts: TrainOptions) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.min_lr + 0.5 * (opts.lr - opts.min_lr) * (1 + math.cos(math.pi * min(progress, 1)))


def _optimizer(pipe: Pipeline, opts: TrainOptions, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and norms)."""
    params = [p for p in pipe.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opts.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=opts.lr, betas=(0.9, 0.95), foreach=True
    )


class _Tied:
    """The tied embedding/head pair as this rank sees it: which copy it holds, if any."""

    def __init__(self, pipe: Pipeline, layers: nn.Sequential) -> None:
        pairs = tied_weights(layers)
        self.enabled = bool(pairs)
        self.embedding = self.head = None
        self.group = None
        if not self.enabled:
            return
        ((embedding, embedding_name, head, head_name),) = pairs
        named = dict(pipe.named_parameters())
        self.embedding = named.get(f"{embedding}.{embedding_name}")
        self.head = named.get(f"{head}.{head_name}")
        if pipe.n_ranks > 1:  # the two ranks of this replica's pipeline that hold them
            ranks = pipe.rank_of(pipe.stage_of(embedding)), pipe.rank_of(pipe.stage_of(head))
            if ranks[0] != ranks[1] and (self.embedding is not None or self.head is not None):
                members = sorted(pipe.global_rank(r) for r in ranks)
                self.group = dist.new_group(members, use_local_synchronization=True)

    def sync_grads(self) -> None:
        """Sum the gradients of the two copies, so both take the same optimizer step."""
        if not self.enabled:
            return
        if self.embedding is not None and self.head is not None:  # both on this stage
            total = self.embedding.grad + self.head.grad
            self.embedding.grad.copy_(total)
            self.head.grad.copy_(total)
        elif self.group is not None:
            copy = self.embedding if self.embedding is not None else self.head
            if copy is not None:
                dist.all_reduce(copy.grad, group=self.group)

    def counted(self, pipe: Pipeline) -> list[nn.Parameter]:
        """Parameters counted in the gradient norm: the head's copy of a tied weight is not."""
        return [p for p in pipe.parameters() if p is not self.head]


def _check_same_text(corpus: bytes, pipe: Pipeline) -> None:
    """Inputs come from the first stage's copy of the text and targets from the last's: on
    several machines, make sure every copy is the same."""
    if dist.get_world_size() == 1:
        return
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(corpus).hexdigest())
    replicas = pipe.replicas.data_parallel if pipe.replicas is not None else 1
    for rank, digest in enumerate(digests):
        if digest != digests[0]:
            raise StageError(
                rank // replicas,  # rank = position in the pipeline x D + replica
                "reads different training text than stage 0 (another Python's standard "
                "library?); pass --data with the same text on every machine",
            )


def _bubble(events: list[Event], n_ranks: int) -> float:
    """The share of the ranks' time in a step not spent computing."""
    start = min(e.start for e in events)
    makespan = max(e.end for e in events) - start
    busy = sum(e.end - e.start for e in events if e.is_compute)
    return 1 - busy / (n_ranks * makespan) if makespan > 0 else 0.0


def _write_timeline(out: Path, events: list[Event], pipe: Pipeline, n_microbatches: int) -> None:
    """The measured step as a Chrome/Perfetto trace, as the interactive page and, with
    matplotlib, as a Gantt chart, each beside the simulator's prediction from the step's own
    measured costs."""
    schedule = pipe.schedule_for(n_microbatches)
    predicted = predict(schedule, events)
    to_chrome(events, out / "trace.json", predicted=predicted)
    bubbles = {
        "measured": _bubble(events, schedule.n_ranks),
        "simulated": _bubble(predicted, schedule.n_ranks),
        "analytic": analytic_bubble(pipe.n_ranks, n_microbatches),
    }
    (out / "bubble.json").write_text(json.dumps(bubbles, indent=1) + "\n")
    write_page(out / "view.html", measured=Measured(schedule, events, pipe.checkpoint))
    try:
        plot_gantt(events, out / "timeline.png", predicted=predicted, title=schedule.name)
    except ImportError as exc:
        print(f"timeline.png not drawn: {exc}", flush=True)


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sample(
    pipe: Pipeline, prompt: str, tokens: int, seq_len: int, seed: int, device: torch.device
) -> str:
    """Generate ``tokens`` bytes through the pipeline: the last stage picks every next token
    and tells the others."""
    generator = torch.Generator().manual_seed(seed)
    context = encode(prompt).view(1, -1)
    pipe.eval()
    for _ in range(tokens):
        logits = pipe(context[:, -seq_len:] if pipe.is_first else None)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        if pipe.is_last:
            probs = torch.softmax(logits[0, -1].float().cpu(), dim=-1)
            token[0, 0] = torch.multinomial(probs, 1, generator=generator).item()
        if pipe.n_ranks > 1:
            last = pipe.global_rank(pipe.rank_of(pipe.n_stages - 1))
            dist.broadcast(token, src=last, group=pipe.group)
        context = torch.cat([context, token.cpu()], dim=1)
    pipe.train()
    return decode(context[0].tolist())


class _Reporter:
    """What the user sees (progress bar or plain lines) and the metrics log; rank 0 only."""

    def __init__(self, opts: TrainOptions, out: Path, first_step: int, enabled: bool) -> None:
        self.opts, self.enabled = opts, enabled
        self.bar = None
        self.log = None
        if not enabled:
            return
        self.log = open(out / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        if not opts.quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=opts.steps, initial=first_step, unit="step", dynamic_ncols=True)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self.log is not None
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        shown = {
            "loss": f"{record['loss']:.3f}",
            "tok/s": f"{record['tokens_per_s']:.0f}",
            "bubble": f"{record['bubble']:.0%}",
        }
        if "val_loss" in record:
            shown["val"] = f"{record['val_loss']:.3f}"
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif record["step"] % 10 == 0 or "val_loss" in record or record["step"] == 1:
            text = " ".join(f"{k} {v}" for k, v in shown.items())
            print(f"step {record['step']}/{self.opts.steps} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()


BALANCE_MODES = ("time", "params", "even")


def parse_balance(value: str, parts: int, n_layers: int) -> list[int] | None:
    """Layers per stage from ``--balance``: a list for explicit counts, None for a mode."""
    if value in BALANCE_MODES:
        return None
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError:
        counts = []
    if len(counts) != parts or sum(counts) != n_layers or min(counts, default=0) < 1:
        raise ValueError(
            f"--balance must be time, params, even, or {parts} positive layer counts that add "
            f"up to the model's {n_layers} layers (such as "
            f"{','.join(map(str, even_balance(n_layers, parts)))}), got {value!r}"
        )
    return counts


def _choose_balance(
    opts: TrainOptions,
    layers: nn.Sequential,
    config: GPTConfig,
    seq_len: int,
    device: torch.device,
    saved: Any,
) -> list[int]:
    """Layers per stage, the same on every rank. By time, the first rank profiles a
    micro-batch of random tokens; a resumed run keeps the balance it was measured with."""
    parts = opts.stages * opts.virtual_stages
    explicit = parse_balance(opts.balance, parts, len(layers))
    if explicit is not None:
        return explicit
    if parts == 1:
        return [len(layers)]
    if opts.balance == "even":
        return even_balance(len(layers), parts)
    if opts.balance == "params":
        return balance_by_params(parts, layers)
    if saved is not None and len(saved) == parts:
        return list(saved)
    init_process_group(device, opts.timeout)
    rows = math.ceil(opts.batch_size / opts.data_parallel / opts.chunks)
    generator = torch.Generator().manual_seed(opts.seed)
    sample = torch.randint(0, config.vocab_size, (rows, seq_len), generator=generator)
    first = dist.get_rank() == 0
    return agreed_balance(layers, parts, sample if first else None, device=device)


def _resume_point(out: Path, required: bool, restarted: bool) -> Path | None:
    """The checkpoint to continue from, the same for every rank: rank 0 clears what unfinished
    saves left and takes the newest checkpoint that verifies (warning of each newer one that
    does not). None for a new run, or a restarted one that has no good checkpoint yet."""
    if not (required or restarted):
        return None
    root = out / "checkpoints"
    choice: list[str | None] = [None]
    if dist.get_rank() == 0:
        discard_partial(root)
        path = latest_checkpoint(root)
        choice = [None if path is None else path.name]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        if required and not restarted:
            raise FileNotFoundError(f"no checkpoint in {root} verifies; nothing to resume from")
        return None
    return root / choice[0]


def _trim_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps up to ``step``: a restarted run logs the steps after its
    checkpoint again, so its log reads as one uninterrupted run's."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
    temporary = path.with_name(f".{path.name}.tmp")  # renamed, so the log is never half gone
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def _step_of(line: str) -> float:
    """The step a metrics line is of; infinite for a line cut short by a lost process."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def run_stage(spec: RunSpec) -> dict[str, Any] | None:
    """Train this rank's stage; returns the run's summary on rank 0 and None elsewhere."""
    opts = TrainOptions(**spec.train)
    config = GPTConfig.from_dict(spec.model)
    out = Path(spec.out)
    seq_len = opts.seq_len or config.seq_len
    device = torch.device(opts.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

    torch.manual_seed(opts.seed)
    layers = build_gpt(config, device="meta", init_seed=opts.seed)
    join_process_group(device, opts.timeout)  # before anything else starts one
    restarted = spec.restarted or restart_count() > 0
    checkpoint = _resume_point(out, spec.resume, restarted)
    measured = read_description(checkpoint).get("balance") if checkpoint else None
    pipe = Pipeline(
        layers,
        _choose_balance(opts, layers, config, seq_len, device, measured),
        chunks=opts.chunks,
        checkpoint=opts.checkpoint,
        schedule=opts.schedule,
        loss_fn=lm_loss,
        device=device,
        data_parallel=opts.data_parallel,
        autocast=PRECISIONS[opts.precision],
        seed=opts.seed,
        timeout=opts.timeout,
        trace=opts.trace,
    )
    k, replicas = pipe.n_ranks, opts.data_parallel
    replica = pipe.replicas.replica if pipe.replicas is not None else 0
    world, me = dist.get_world_size(), dist.get_rank()
    root = me == 0  # reports, logs and returns the summary
    tied = _Tied(pipe, layers)
    optimizer = _optimizer(pipe, opts, device)
    # float16 needs its loss scaled; bfloat16 has float32's range and needs none
    scaler = torch.amp.GradScaler(device.type) if opts.precision == "fp16" else None

    def mine(batch: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a global mini-batch."""
        return shard(batch, replica, replicas) if replicas > 1 else batch

    corpus = load_corpus(opts.data)
    _check_same_text(corpus, pipe)
    dataset = ByteDataset.split(corpus)
    sampler = BatchSampler(dataset.train, opts.batch_size, seq_len, seed=opts.seed)
    step = 0
    if checkpoint is not None:
        held = {"sampler": sampler.state_dict(), "step": 0}
        if scaler is not None:
            held["scaler"] = scaler.state_dict()
        restored = load_checkpoint(checkpoint, pipe, optimizer, held, group=pipe.group)
        sampler.load_state_dict(restored["sampler"])
        step = int(restored["step"])
        if scaler is not None:
            scaler.load_state_dict(restored["scaler"])
    if root and (spec.resume or restarted):
        _trim_metrics(out / "metrics.jsonl", step)
        how = "restarted" if restarted else "resumed"
        where = f"from {checkpoint}" if checkpoint else "with no checkpoint to continue from"
        print(f"{how} {where}: training from step {step}, stages {pipe.balance}", flush=True)

    def evaluate() -> float:
        pipe.eval()
        val = BatchSampler(dataset.val, opts.batch_size, seq_len, seed=opts.seed + 1)
        losses = []
        for _ in range(opts.eval_batches):
            x, y = val.next()
            losses.append(float(pipe.evaluate(mine(x) if pipe.is_first else None, mine(y))))
        pipe.train()
        return sum(losses) / len(losses)

    def save() -> None:
        """Once per stage: the replicas hold the same weights and optimizer state (their
        gradients are summed, their BatchNorm statistics merged), so replica 0 writes."""
        if replica != 0:
            return
        description = {
            "model": asdict(config),
            "train": asdict(opts),
            "stages": k,
            "data_parallel": replicas,
            "balance": pipe.balance,
        }
        extra: dict[str, Any] = {"sampler": sampler.state_dict(), "step": step}
        if scaler is not None:
            extra["scaler"] = scaler.state_dict()
        save_checkpoint(
            out / "checkpoints",
            step,
            pipe,
            optimizer,
            extra,
            description,
            group=pipe.group,
            on_written=lambda: kill_point("save", step),
        )

    reporter = _Reporter(opts, out, step, enabled=root)
    tokens = opts.batch_size * seq_len
    started, trained_from = time.perf_counter(), step
    train_loss = val_loss = float("nan")
    try:
        while step < opts.steps:
            kill_point("step", step + 1)  # tests only: GPIPE_TEST_KILL loses this process
            # Dropout draws from a seed of the step, so a resumed run draws the same masks.
            torch.manual_seed(opts.seed * 1_000_003 + step * world + me)
            lr = learning_rate(step, opts)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = sampler.next()  # the global mini-batch, the same on every rank
            x, y = mine(x), mine(y)
            tick = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = pipe.step(
                x if pipe.is_first else None, y if pipe.is_last else None, scaler=scaler
            )
            tied.sync_grads()
            norm = pipe.clip_grad_norm_(
                opts.grad_clip, parameters=tied.counted(pipe), scaler=scaler, optimizer=optimizer
            )
            if scaler is not None:
                scaler.step(optimizer)  # skipped, on every rank alike, if a gradient overflowed
                scaler.update()
            else:
                optimizer.step()
            seconds = time.perf_counter() - tick
            step += 1
            assert pipe.last_step is not None
            times = torch.tensor([pipe.last_step.busy, pipe.last_step.total], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(times)
            train_loss = float(loss)
            if opts.trace and step == opts.steps:  # collective, before evaluate() records
                events = pipe.timeline()
                if root:
                    _write_timeline(out, events, pipe, len(split_sizes(len(x), opts.chunks)))
            record: dict[str, Any] = {
                "step": step,
                "loss": train_loss,
                "lr": lr,
                "grad_norm": float(norm),
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "bubble": float(1 - times[0] / times[1]),
            }
            if step % opts.eval_every == 0 or step == opts.steps:
                val_loss = record["val_loss"] = evaluate()
            reporter.step(record)
            if opts.save_every and step % opts.save_every == 0 and step != opts.steps:
                save()
    finally:
        reporter.close()
    elapsed = time.perf_counter() - started
    save()
    sample = _sample(pipe, opts.prompt, opts.sample_tokens, seq_len, opts.seed, device)
    memory: list[int] = [0] * world
    if world > 1:
        dist.all_gather_object(memory, _peak_memory(device))
    else:
        memory = [_peak_memory(device)]
    if not root:
        return None
    steps_run = step - trained_from
    return {
        "steps": step,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "seconds": elapsed,
        "tokens_per_s": steps_run * tokens / elapsed if elapsed > 0 else 0.0,
        "peak_memory_bytes": memory,
        "sample": sample,
        "balance": pipe.balance,
    }
