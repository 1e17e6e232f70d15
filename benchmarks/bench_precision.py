"""``gpipe train`` in float32, bfloat16 and float16: tokens per second and the losses reached.

Each round runs the main job once per precision, in rotating order, with the same seed and
steps; tokens per second is the median over the steps after the first ten, the losses are
the last step's training loss and the final validation loss. The figures are medians over
the rounds.

    python -m benchmarks.bench_precision            # 3 rounds of 100 steps, ~15 minutes
    python -m benchmarks.bench_precision --quick    # the tiny model, to check that it runs
    python -m benchmarks.bench_precision --results precision-cuda -- --device cuda --stages 1
                                                     # more train flags after --
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import machine, write_results

PRECISIONS = ("fp32", "bf16", "fp16")


def _train(precision: str, out: Path, steps: int, more: list[str]) -> dict[str, float]:
    subprocess.run(
        [sys.executable, "-m", "gpipe.cli", "train", "--precision", precision, "--steps",
         str(steps), "--eval-every", str(steps), "--quiet", "--out", str(out), *more],
        check=True,
        capture_output=True,
        timeout=3600,
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[10:]),
        "train_loss": rows[-1]["loss"],
        "val_loss": rows[-1]["val_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny preset, to check it runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--results", default=None, help="the results file's name")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER, help="-- then gpipe train flags")
    args = parser.parse_args()
    more = ["--preset", "tiny", "--batch-size", "8"] if args.quick else []
    more += [flag for flag in args.train_flags if flag != "--"]
    steps = 20 if args.quick else args.steps
    precisions = tuple(args.precisions.split(","))
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in precisions}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            shift = round_ % len(precisions)
            for precision in precisions[shift:] + precisions[:shift]:
                out = Path(tmp) / f"{precision}-{round_}"
                runs[precision].append(_train(precision, out, steps, more))
                print(f"round {round_} {precision}: {runs[precision][-1]}", flush=True)
    summary = {
        p: {key: statistics.median(r[key] for r in found) for key in found[0]}
        for p, found in runs.items()
    }
    print(
        f"gpipe train{' ' + ' '.join(more) if more else ''}, {steps} steps, "
        f"{args.rounds} rounds (medians)"
    )
    print(f"{'precision':>9} {'tokens/s':>9} {'/ fp32':>7} {'train loss':>11} {'val loss':>9}")
    for p, s in summary.items():
        ratio = s["tokens_per_s"] / summary["fp32"]["tokens_per_s"]
        print(
            f"{p:>9} {s['tokens_per_s']:9.0f} {ratio:7.3f} {s['train_loss']:11.3f} "
            f"{s['val_loss']:9.3f}"
        )
    path = write_results(
        args.results or ("precision-quick" if args.quick else "precision"),
        {"machine": machine(), "steps": steps, "more": more, "runs": runs, "summary": summary},
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
