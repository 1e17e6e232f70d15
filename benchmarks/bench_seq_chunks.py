"""Sequence-pipelined micro-batches (Seq1F1B): peak activation memory and step time of the
GPT under 1F1B with each micro-batch cut into S = 1, 2, 4 sub-sequences.

Memory: each (K, S) in fresh processes of one thread, one warm-up step and one step under
``ActivationMeter`` (saved tensors and layer inputs and outputs, each storage once, parameters
left out); K = 2 and 4 by default (how much a process holds depends only on the order of its
actions, so more processes than cores are measured on this 2-core machine too; K = 8 needs
``--layers 6``: the model's blocks plus its embedding and head, one stage each). Time: S = 1,
2, 4 in one pair of processes of one thread each, one step each in turn, the order rotating
every cycle; medians, and each step over S = 1's in the same cycle.

The workload: ``GPTConfig(n_layer=4, d_model=128, n_head=4)``, sequences of 2048 tokens,
M = 8 micro-batches of one row, no re-materialization.

    python -m benchmarks.bench_seq_chunks                  # memory, results/seq-chunks.json
    python -m benchmarks.bench_seq_chunks --width 512      # results/seq-chunks-width512.json
    python -m benchmarks.bench_seq_chunks --layers 6 --stages 8   # seq-chunks-layers6.json
    python -m benchmarks.bench_seq_chunks --schedule zero-bubble-v   # ...-zero-bubble-v.json
    python -m benchmarks.bench_seq_chunks --time --repeats 7   # results/seq-chunks-time.json
    python -m benchmarks.bench_seq_chunks --time --compile   # seq-chunks-time-compiled.json

``--compile``: S = 1 and S = 4 balanced, each eager and with ``compile=True`` (torch.compile's
default backend; the warm-up step compiles).
"""

from __future__ import annotations

import argparse

import torch

from gpipe import Pipeline, launch
from gpipe.models import GPTConfig, build_gpt, lm_loss
from gpipe.runtime import even_balance
from gpipe.schedules import SEQ_CHUNKED, Placement, traits

from .common import activation_peak, machine, over_baseline, steps_in_turn, write_results

# the step-time contenders: (S, seq_split)
TIMED = {
    "S=1": (1, "even"),
    "S=2": (2, "even"),
    "S=4": (4, "even"),
    "S=4 balanced": (4, "balanced"),
}
# with --compile: (S, seq_split, compiled)
COMPILED = {
    "S=1": (1, "even", False),
    "S=1 compiled": (1, "even", True),
    "S=4 balanced": (4, "balanced", False),
    "S=4 balanced compiled": (4, "balanced", True),
}
LAYERS, WIDTH, HEADS, LENGTH, CHUNKS = 4, 128, 4, 2048, 8


def _pipeline(
    k: int,
    seq_chunks: int,
    length: int,
    width: int = WIDTH,
    split: str = "even",
    blocks: int = LAYERS,
    compiled: bool = False,
    schedule: str = "1f1b",
) -> Pipeline:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=blocks, d_model=width, n_head=HEADS, seq_len=length)
    layers = blocks + 2
    if traits(schedule).placement is Placement.V:  # two stages a process, as many blocks
        balance = even_balance(blocks, 2 * k)
        balance[0] += 1  # the embedding, and the head: both on the first process
        balance[-1] += 1
    else:
        balance = [layers // k + (1 if s < layers % k else 0) for s in range(k)]
    return Pipeline(
        build_gpt(config),
        balance,
        chunks=CHUNKS,
        checkpoint="never",
        schedule=schedule,
        loss_fn=lm_loss,
        seq_chunks=seq_chunks,
        seq_split=split,
        compile=compiled,
    )


def _batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (CHUNKS, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def peak(
    k: int, seq_chunks: int, length: int, width: int, split: str, blocks: int, schedule: str
) -> int:
    """This process's peak activation bytes in one step."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    pipe = _pipeline(k, seq_chunks, length, width, split, blocks, schedule=schedule)
    return activation_peak(pipe, *_batch(length))


def timed(
    repeats: int, warmup: int, length: int, compiled: bool, schedule: str
) -> dict[str, list[float]]:
    """Seconds per step of every contender, K = 2, taking turns in one pair of processes;
    under another schedule than 1F1B, 1F1B on whole micro-batches too."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    contenders = COMPILED if compiled else {n: (*c, False) for n, c in TIMED.items()}
    pipes = {
        name: _pipeline(2, s, length, split=split, compiled=c, schedule=schedule)
        for name, (s, split, c) in contenders.items()
    }
    if schedule != "1f1b":
        pipes["1f1b S=1"] = _pipeline(2, 1, length)
    x, y = _batch(length)
    return steps_in_turn(pipes, x, y, repeats, warmup)


def _time(repeats: int, length: int, compiled: bool, schedule: str) -> None:
    seconds = launch(timed, 2, (repeats, 1, length, compiled, schedule), threads=1)[0]
    report: dict = {
        "machine": machine(),
        "repeats": repeats,
        "length": length,
        "schedule": schedule,
        "seq_chunks": {},
    }
    for name, (times, ratios) in over_baseline(seconds, "S=1", "S=1").items():
        report["seq_chunks"][name] = {"seconds": times, "over_one_per_cycle": ratios}
    if compiled:  # each compiled contender over its eager twin, per cycle
        report["compiled_over_eager_per_cycle"] = {}
        for eager in ("S=1", "S=4 balanced"):
            pair = {n: seconds[n] for n in (eager, f"{eager} compiled")}
            _, ratios = over_baseline(pair, eager, eager)[f"{eager} compiled"]
            report["compiled_over_eager_per_cycle"][eager] = ratios
    name = "seq-chunks-time" + ("-compiled" if compiled else "")
    name += f"-{schedule}" if schedule != "1f1b" else ""
    print(f"written to {write_results(name, report)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", action="store_true", help="step times at K = 2 instead")
    parser.add_argument("--repeats", type=int, default=7, help="measured cycles of --time")
    parser.add_argument(
        "--compile", action="store_true", help="--time: eager against compiled layers"
    )
    parser.add_argument("--length", type=int, default=LENGTH, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=WIDTH, help="d_model of the memory runs")
    parser.add_argument("--layers", type=int, default=LAYERS, help="blocks of the memory runs")
    parser.add_argument(
        "--stages", default="2,4", help="the memory runs' numbers of processes, comma-separated"
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=sorted(SEQ_CHUNKED),
        help="the schedule of the memory or time runs (default 1f1b)",
    )
    args = parser.parse_args()
    stages = [int(k) for k in args.stages.split(",")]
    if args.time:
        _time(args.repeats, args.length, args.compile, args.schedule)
        return
    per_process = traits(args.schedule).stages_per_rank(1)
    if max(stages) * per_process > args.layers + 2:
        parser.error(f"--stages {args.stages}: the model has {args.layers + 2} layers to cut")
    report: dict = {
        "workload": dict(
            layers=args.layers,
            width=args.width,
            length=args.length,
            chunks=CHUNKS,
            schedule=args.schedule,
        ),
        "machine": machine(),
        "peaks": {},
    }
    for k in stages:
        peaks = {}
        for name, (s, split) in TIMED.items():
            run = (k, s, args.length, args.width, split, args.layers, args.schedule)
            per_rank = launch(peak, k, run, threads=1)
            peaks[name] = [per_rank[r] for r in range(k)]
        for name in TIMED:
            busiest = max(peaks[name])
            ratio = busiest / max(peaks["S=1"])
            report["peaks"][f"K={k}/{name}"] = {
                "per_process_mib": [p / 2**20 for p in peaks[name]],
                "busiest_over_s1": ratio,
            }
            print(
                f"K={k} {name:13s} busiest {busiest / 2**20:7.1f} MiB = {ratio:.3f} x S=1's; "
                "per process " + ", ".join(f"{p / 2**20:.1f}" for p in peaks[name]),
                flush=True,
            )
    name = "seq-chunks" + (f"-width{args.width}" if args.width != WIDTH else "")
    name += f"-layers{args.layers}" if args.layers != LAYERS else ""
    name += f"-{args.schedule}" if args.schedule != "1f1b" else ""
    print(f"written to {write_results(name, report)}")


if __name__ == "__main__":
    main()
