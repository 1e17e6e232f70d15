"""Generating from a run's checkpoint through its stages, one process per stage as it
trained: what ``gpipe generate`` and ``gpipe sample`` run.

Each process builds its stage as the run built it (the GPT's layers on the meta device, or
the stages ``gpipe.split`` cut), loads its share of the checkpoint, and joins
``Pipeline.generate``; the first process plans, shows progress and returns the tokens. To
generate, a Hugging Face model the run traced (traced stages keep no KV cache) is cut again
by the layout of its modules first (``gpipe.training.hf.generation_cut``); a sample continued
past the window runs the run's own stages, as the run drew its own sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from gpipe.comm.process_group import rank_device
from gpipe.engine.generation import GenerationRefused
from gpipe.pipeline import Pipeline
from gpipe.training.checkpoints.format import read_run_record
from gpipe.training.checkpoints.safe_reading import load_state
from gpipe.training.hf.generation_cut import cut_for_generation
from gpipe.training.models.sources import TrainModel, model_from_dict
from gpipe.training.models.trained import check_code_named
from gpipe.training.options import PRECISIONS, TrainOptions
from gpipe.training.sample_text import continued

__all__ = [
    "GenerateJob",
    "Generated",
    "generate_from_run",
    "generating_pipeline",
    "lanes_and_rows",
    "stage_pipeline",
    "stages_of",
]


@dataclass(frozen=True)
class GenerateJob:
    """What to generate from ``checkpoint``: ``Pipeline.generate``'s arguments (``options``:
    ``temperature``, ``top_k``, ``top_p``, ``seed``, ``eos_token_id``, ``in_flight``,
    ``prefill_chunk``), at most ``batch`` sequences in flight in all (None: every prompt),
    a progress bar if ``progress``; ``code`` names the run's own module, if it has one.
    With a ``window`` (a context), the one prompt is continued past it as the run's own
    sample is (``gpipe.training.sample_text.continued``)."""

    checkpoint: str
    prompts: list[list[int]]
    max_new_tokens: int
    options: dict[str, Any] = field(default_factory=dict)
    batch: int | None = None
    code: str | None = None
    progress: bool = False
    window: int | None = None


@dataclass(frozen=True)
class Generated:
    """The new tokens of each prompt, and the seconds generating took (load excluded);
    ``refused`` (and no tokens) where the run's model cannot keep a KV cache or ``generate``
    refused the prompts or settings."""

    tokens: list[list[int]]
    seconds: float
    refused: str | None = None


def stages_of(checkpoint: Path) -> int:
    """How many stages the run cut its model into (a process each while generating)."""
    return len(read_run_record(checkpoint)["balance"])


def stage_pipeline(checkpoint: Path, code: str | None = None) -> Pipeline:
    """This rank's stage of the run's model, as the run built it, with the checkpoint's weights
    (collective over the stages' processes)."""
    return _loaded(checkpoint, code)[0]


def generating_pipeline(checkpoint: Path, code: str | None = None) -> Pipeline:
    """``stage_pipeline``, or where the run traced a Hugging Face model (stages that keep no
    KV cache), the same weights in the stages its layout cuts at the same places
    (``gpipe.training.hf.generation_cut``)."""
    return cut_for_generation(*_loaded(checkpoint, code))


def _loaded(
    checkpoint: Path, code: str | None
) -> tuple[Pipeline, nn.Sequential, TrainModel, Callable[[nn.Sequential, list[int]], Pipeline]]:
    """The run's stages loaded from ``checkpoint``, the model they were cut from, and how the
    run makes a pipeline of stages."""
    record = read_run_record(checkpoint)
    model = model_from_dict(record["model"])
    check_code_named(model, checkpoint, code)
    opts = TrainOptions(**record["train"])
    balance = [int(n) for n in record["balance"]]
    layers = model.layers(len(balance), opts.seed, opts.balance)

    def make(stages: nn.Sequential, held: list[int]) -> Pipeline:
        return Pipeline(
            stages,
            held,
            device=rank_device(opts.device),
            autocast=PRECISIONS[opts.precision],
            seed=opts.seed,
            timeout=opts.timeout,
        )

    pipe = make(layers, balance if len(layers) == sum(balance) else [1] * len(layers))
    model.load_weights(layers, pipe)  # buffers a checkpoint does not hold
    state = {"model": pipe.state_dict()}
    load_state(state, checkpoint, process_group=pipe.group)
    pipe.load_state_dict(state["model"])
    return pipe, layers, model, make


def lanes_and_rows(batch: int, in_flight: int) -> tuple[int, int]:
    """Lanes, and sequences in each, that hold at most ``batch`` sequences in all: fewer
    lanes than ``in_flight`` where there are not sequences enough to fill them."""
    lanes = min(in_flight, batch)
    return lanes, batch // lanes


def _run(job: GenerateJob) -> Generated | None:
    """One rank's part; the first stage's rank returns what came out."""
    # a window continues one prompt as the run drew its own sample, through its own stages
    build = stage_pipeline if job.window is not None else generating_pipeline
    try:
        pipe = build(Path(job.checkpoint), job.code)
    except ValueError as exc:  # every rank alike: a checkpoint that cannot be loaded
        return Generated([], 0.0, str(exc).splitlines()[0])
    bar = None
    if job.progress and pipe.is_first:
        from tqdm import tqdm

        bar = tqdm(total=len(job.prompts) * job.max_new_tokens, unit="tok", dynamic_ncols=True)
    try:
        generator = pipe.generator()
    except GenerationRefused as exc:
        return Generated([], 0.0, str(exc)) if pipe.is_first else None
    started = time.perf_counter()
    if job.window is not None:
        o = job.options
        found = continued(
            pipe,
            job.prompts[0],
            job.max_new_tokens,
            job.window,
            seed=o.get("seed") or 0,
            temperature=o.get("temperature", 1.0),
            top_k=o.get("top_k"),
        )
        seconds = time.perf_counter() - started
        return Generated([found], seconds) if pipe.is_first else None
    options = dict(job.options)
    rows = None
    if job.batch is not None:
        lanes, rows = lanes_and_rows(job.batch, options.get("in_flight") or pipe.n_stages)
        options["in_flight"] = lanes

    def advance(n: int) -> None:
        if bar is not None:
            bar.update(n)

    started = time.perf_counter()
    try:
        tokens = generator.generate(
            job.prompts if pipe.is_first else None,
            job.max_new_tokens,
            rows_per_lane=rows,
            on_tokens=advance,
            **options,
        )
    except (ValueError, TypeError) as exc:
        # generate() refuses bad prompts and settings on every rank alike, before anything
        # runs: the command reports the refusal in one line, as it reports its own flags'
        return Generated([], 0.0, str(exc)) if pipe.is_first else None
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    return Generated(tokens, seconds) if pipe.is_first else None


def generate_from_run(job: GenerateJob, threads: int | None = None) -> Generated:
    """Generate through the run's stages in local processes (as many as it has stages)."""
    import gpipe.training.launch as launching

    processes = stages_of(Path(job.checkpoint))
    threads = threads or launching.threads_per_process(processes)
    found = launching.launch(_run, processes, (job,), threads=threads)[0]
    assert found is not None  # the first stage's rank answers
    return found
