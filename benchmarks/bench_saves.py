"""What a checkpoint costs the training steps: written in the background against written
while training waits, on the GPT in 2 stages (2 processes, one thread each).

Each cycle runs three windows of the same steps in rotating order: one with no save, one
that saves in the foreground (``CheckpointWriter(background=False)``) before its first step,
one that saves in the background; a window ends when its save is complete, so a background
save still being written after the last step is counted too. A save's cost is its window's
time less the window without one; the ratio (background / foreground) is taken per cycle and
the figures are medians over the cycles. Retention keeps one checkpoint, so the disk holds
at most two while they are written.

    python -m benchmarks.bench_saves             # the GPT of the benchmarks, 7 cycles
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
from gpipe.training.checkpoint_writer import CheckpointWriter
from gpipe.training.models.gpt import GPTConfig, build_gpt, lm_loss
from gpipe.training.retention import Retention

from .common import gpt_model, machine, quick_or_repeats, write_results

MODES = ("none", "foreground", "background")


def _window(pipe, optimizer, batch, steps: int, writer, step: int) -> float:
    """Seconds of ``steps`` training steps after a save with ``writer`` (None: no save),
    until the save is complete; the slower rank's."""
    x, y = batch
    dist.barrier()
    start = perf_counter()
    if writer is not None:
        writer.save(step, pipe, optimizer, {"step": step}, {"benchmark": "saves"})
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        optimizer.step()
    if writer is not None:
        writer.wait()
    took = torch.tensor([perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def side_by_side(cfg: dict) -> dict:
    from gpipe.pipeline import init_process_group

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
        "none": None,
        "foreground": CheckpointWriter(root / "fg", pipe, retention=keep_one, background=False),
        "background": CheckpointWriter(root / "bg", pipe, retention=keep_one),
    }
    for mode in MODES:  # warm-up: the first save of each kind pays for imports and folders
        _window(pipe, optimizer, batch, 1, writers[mode], 0)
    cycles = []
    for cycle in range(cfg["repeats"]):
        shift = cycle % len(MODES)
        order = MODES[shift:] + MODES[:shift]
        cycles.append(
            {m: _window(pipe, optimizer, batch, cfg["steps"], writers[m], cycle + 1) for m in order}
        )
    state = sum(t.numel() * t.element_size() for t in pipe.state_dict().values())
    states = [0] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return {"cycles": cycles, "model_bytes_per_rank": states}


def _summary(cycles: list[dict]) -> dict:
    costs = {m: [c[m] - c["none"] for c in cycles] for m in ("foreground", "background")}
    ratios = [b / f for b, f in zip(costs["background"], costs["foreground"], strict=True)]
    return {
        "window_s": {m: statistics.median(c[m] for c in cycles) for m in MODES},
        "cost_s": {m: statistics.median(v) for m, v in costs.items()},
        "ratio_background_to_foreground": statistics.median(ratios),
        "ratios": ratios,
    }


def main() -> None:
    args = quick_or_repeats(__doc__, repeats=7)
    model = gpt_model(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {
            "model": model,
            "batch": 8 if args.quick else 32,
            "chunks": 4 if args.quick else 8,
            "steps": 4 if args.quick else 8,
            "repeats": args.repeats,
            "root": tmp,
        }
        found = launch(side_by_side, 2, (cfg,), threads=1)[0]
    summary = _summary(found["cycles"])
    name = "saves-quick" if args.quick else "saves"
    print(f"GPT {model}, 2 stages, {cfg['steps']} steps a window, {args.repeats} cycles")
    print(f"state per rank (model only): {[b / 2**20 for b in found['model_bytes_per_rank']]} MiB")
    for mode in MODES:
        print(f"{mode:>11}: window {summary['window_s'][mode]:.3f} s")
    for mode, cost in summary["cost_s"].items():
        print(f"{mode:>11}: a save costs {cost * 1000:.0f} ms of training")
    print(f"background / foreground (median of per-cycle ratios): "
          f"{summary['ratio_background_to_foreground']:.3f}")  # fmt: skip
    path = write_results(name, {"machine": machine(), "config": cfg | {"root": None},
                                "cycles": found["cycles"], "summary": summary})  # fmt: skip
    print(f"written to {path}")


if __name__ == "__main__":
    main()
