"""What a checkpoint costs the training steps: written in the background against written
while training waits, on a GPT in 2 stages (2 processes, one thread each). In the background
it is written by a helper process of each rank (the default for a state this large) and, for
comparison, by a thread.

Each cycle runs the three kinds of save in rotating order, each in a stretch of steps of its own:
three steps, whose median is the stretch's step time without a save, then the save, then
steps until the save is complete, and one more. A save's cost is what it added to the
stretch: the time the ``save`` call held training (the whole write in the foreground, the
copy of the state in the background), plus what each step after it took beyond the
stretch's step time, plus any wait for the save at the end. Step times are the slower
rank's. The ratios (background / foreground, thread / foreground) are taken per cycle; the
figures are medians over the cycles. Retention keeps one checkpoint of each kind.

    python -m benchmarks.bench_saves             # 11 cycles, about 3 minutes on 2 cores
    python -m benchmarks.bench_saves --quick     # small sizes, to check that it runs
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist

from gpipe import Pipeline, launch
from gpipe.models import GPTConfig, build_gpt, lm_loss
from gpipe.training.checkpoints.retention import Retention
from gpipe.training.checkpoints.writer import CheckpointWriter

from .common import gpt_model, machine, quick_or_repeats, write_results

# The benchmarks' GPT made wider and fed short sequences: 25 M parameters (about 150 MB of
# weights and AdamW state per process) against steps of a few tenths of a second, so that a
# save weighs against a step as a large model's does (gigabytes against seconds), and the
# steps' noise does not hide it.
WIDE = {"n_layer": 8, "d_model": 512, "n_head": 8, "seq_len": 32, "dropout": 0.0}

# in the background by a helper process (the default for a state this large), or by a thread
MODES = ("foreground", "background", "thread")
LEAD = 3  # steps before a save: their median is the step time without one
MOST = 12  # steps a background save may overlap before the stretch waits for it


def _agreed(seconds: float, busy: bool) -> tuple[float, bool]:
    """The slower rank's seconds, and whether any rank's save is still being written."""
    found = torch.tensor([seconds, float(busy)], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return float(found[0]), bool(found[1])


def _timed(pipe, optimizer, batch, writer) -> tuple[float, bool]:
    x, y = batch
    dist.barrier()
    start = perf_counter()
    optimizer.zero_grad(set_to_none=True)
    pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    optimizer.step()
    return _agreed(perf_counter() - start, writer.in_flight is not None)


def _stretch(pipe, optimizer, batch, writer, step: int) -> dict[str, float]:
    """A save's cost in a stretch of steps, as the module's docstring says."""
    lead = statistics.median(_timed(pipe, optimizer, batch, writer)[0] for _ in range(LEAD))
    dist.barrier()
    start = perf_counter()
    writer.save(step, pipe, optimizer, {"step": step}, {"benchmark": "saves"})
    held, busy = _agreed(perf_counter() - start, writer.in_flight is not None)
    after = []
    while busy and len(after) < MOST:
        seconds, busy = _timed(pipe, optimizer, batch, writer)
        after.append(seconds)
    dist.barrier()
    start = perf_counter()
    writer.wait()
    waited, _ = _agreed(perf_counter() - start, False)
    after.append(_timed(pipe, optimizer, batch, writer)[0])  # and one more
    slower = sum(t - lead for t in after)
    return {"step_s": lead, "held_s": held, "slower_s": slower, "waited_s": waited,
            "steps_overlapped": len(after) - 1, "cost_s": held + slower + waited}  # fmt: skip


def side_by_side(cfg: dict) -> dict:
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    config = GPTConfig(**cfg["model"])
    torch.manual_seed(0)
    pipe = Pipeline(build_gpt(config), chunks=cfg["chunks"], loss_fn=lm_loss, checkpoint="never")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (cfg["batch"], config.seq_len + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    root = Path(cfg["root"])
    keep_one = Retention(keep=1)
    writers = {
        "foreground": CheckpointWriter(root / "fg", pipe, retention=keep_one, background=False),
        "background": CheckpointWriter(root / "bg", pipe, retention=keep_one, process=True),
        "thread": CheckpointWriter(root / "th", pipe, retention=keep_one, process=False),
    }
    for mode in MODES:  # warm-up: the first save of each kind pays for imports and folders
        _stretch(pipe, optimizer, batch, writers[mode], 0)
    cycles = []
    for cycle in range(cfg["repeats"]):
        order = MODES[cycle % 3 :] + MODES[: cycle % 3]
        cycles.append({m: _stretch(pipe, optimizer, batch, writers[m], cycle + 1) for m in order})
    state = sum(t.numel() * t.element_size() for t in pipe.state_dict().values())
    states = [0] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return {"cycles": cycles, "model_bytes_per_rank": states}


def _summary(cycles: list[dict]) -> dict:
    ratios = [c["background"]["cost_s"] / c["foreground"]["cost_s"] for c in cycles]
    threads = [c["thread"]["cost_s"] / c["foreground"]["cost_s"] for c in cycles]
    return {
        mode: {key: statistics.median(c[mode][key] for c in cycles) for key in cycles[0][mode]}
        for mode in MODES
    } | {
        "ratio_background_to_foreground": statistics.median(ratios),
        "ratios": ratios,
        "ratio_thread_to_foreground": statistics.median(threads),
        "thread_ratios": threads,
    }


def main() -> None:
    args = quick_or_repeats(__doc__, repeats=11)
    model = gpt_model(True) if args.quick else WIDE
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model": model, "batch": 8, "chunks": 4, "repeats": args.repeats, "root": tmp}
        found = launch(side_by_side, 2, (cfg,), threads=1)[0]
    summary = _summary(found["cycles"])
    print(
        f"GPT {model}, 2 stages, batch {cfg['batch']} in {cfg['chunks']} micro-batches, "
        f"{args.repeats} cycles (medians)"
    )
    print(
        f"weights per rank: {[round(b / 2**20) for b in found['model_bytes_per_rank']]} MiB "
        "(AdamW's state twice that)"
    )
    for mode in MODES:
        m = summary[mode]
        print(
            f"{mode:>11}: a step {m['step_s'] * 1000:.0f} ms; a save costs "
            f"{m['cost_s'] * 1000:.0f} ms (held {m['held_s'] * 1000:.0f}, steps slower by "
            f"{m['slower_s'] * 1000:.0f} over {m['steps_overlapped']:.0f}, waited "
            f"{m['waited_s'] * 1000:.0f})"
        )
    print(
        f"background / foreground (median of per-cycle ratios): "
        f"{summary['ratio_background_to_foreground']:.3f}; by a thread instead of a process: "
        f"{summary['ratio_thread_to_foreground']:.3f}"
    )
    name = "saves-quick" if args.quick else "saves"
    path = write_results(
        name,
        {
            "machine": machine(),
            "config": cfg | {"root": None},
            "cycles": found["cycles"],
            "summary": summary,
        },
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
