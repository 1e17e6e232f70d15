"""The main job's bubble and throughput: ``gpipe train`` with its default settings, at this
revision and at another one, runs in turn.

For each run: tokens per second and the measured bubble (medians over the steps after the
first ten), and at this revision the traced last step's measured bubble beside the
simulator's prediction from that step's own measured costs (which includes any imbalance
between the stages) and the schedule's analytic bubble.

    python -m benchmarks.bench_train 87cbb30            # two runs of each, ~8 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import machine, write_results
from .compare_revisions import extract


def _train(command: list[str], out: Path, env: dict[str, str], steps: int) -> dict:
    subprocess.run(
        [*command, "train", "--steps", str(steps), "--quiet", "--out", str(out), "--trace"],
        check=True,
        env=env,
        capture_output=True,
        timeout=1800,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[10:]
    result = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
        "bubble": statistics.median(r["bubble"] for r in later),
    }
    traced = out / "bubble.json"
    if traced.exists():
        result["traced_step"] = json.loads(traced.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the git revision to compare with")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        package = extract(args.rev, Path(tmp))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([tmp, env.get("PYTHONPATH", "")])
        commands = {
            "before": [
                sys.executable,
                "-c",
                f"import sys; from {package}.cli import main; sys.exit(main(sys.argv[1:]))",
            ],
            "after": [sys.executable, "-m", "gpipe.cli"],
        }
        for run in range(args.runs):
            for name in ("before", "after") if run % 2 == 0 else ("after", "before"):
                out = Path(tmp) / f"{name}-{run}"
                got = _train(commands[name], out, env, args.steps)
                results[name].append(got)
                print(name, json.dumps(got), flush=True)
    summary = {
        name: {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "bubble": statistics.median(r["bubble"] for r in runs),
        }
        for name, runs in results.items()
    }
    traced = [r["traced_step"] for r in results["after"] if "traced_step" in r]
    if traced:
        measured = statistics.median(t["measured"] for t in traced)
        simulated = statistics.median(t["simulated"] for t in traced)
        analytic = traced[0]["analytic"]
        summary["after"] |= {
            "bubble_over_analytic": summary["after"]["bubble"] / analytic,
            "traced_over_simulated": measured / simulated if simulated else None,
            "analytic": analytic,
        }
    print(json.dumps(summary, indent=1))
    report = {"machine": machine(), "rev": args.rev, "runs": results, "summary": summary}
    print(f"written to {write_results('train-bubble', report)}")


if __name__ == "__main__":
    main()
