"""A split model's bubble against a Sequential's: ``gpipe train`` on the built-in GPT and on a
Hugging Face Llama of about its size (built from a config, cut by ``gpipe.split``), the same
stages, micro-batches, batch and data, runs alternating.

For each run: the median over the steps after the first ten of the measured bubble (the share
of the step the ranks together spent not computing) and of the tokens per second; the
summary gives each model's median over its runs and its ratio to the schedule's analytic
bubble, (K - 1) / (M + K - 1).

    python -m benchmarks.bench_models               # 3 runs of each, ~4 minutes on 2 cores
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

SHAPE = ["--stages", "2", "--chunks", "8", "--batch-size", "32", "--seq-len", "128"]


def _llama_config(folder: Path) -> Path:
    """A Llama of the 'small' GPT's shape: 4 blocks, width 128, 4 heads, MLP 512, bytes."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    ).save_pretrained(folder)
    return folder / "config.json"


def _run(model: list[str], out: Path, steps: int) -> dict[str, float]:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gpipe.cli", "train", *model, *SHAPE, "--steps", str(steps)]
    command += ["--quiet", "--eval-every", str(steps), "--save-every", "0", "--sample-tokens", "1"]
    subprocess.run([*command, "--out", str(out), "--force"], check=True, env=env,
                   capture_output=True, timeout=1800)  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[10:]
    return {
        "bubble": statistics.median(r["bubble"] for r in later),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    analytic = 1 / (8 + 2 - 1)
    with tempfile.TemporaryDirectory() as tmp:
        config = _llama_config(Path(tmp) / "llama")
        models = {"gpt": ["--model", "gpt"], "llama": ["--model", f"hf:{config}"]}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in models}
        for i in range(args.runs):
            for name, flags in models.items():
                runs[name].append(_run(flags, Path(tmp) / f"{name}-{i}", args.steps))
                print(name, i, runs[name][-1], flush=True)
    summary = {}
    for name, found in runs.items():
        bubble = statistics.median(r["bubble"] for r in found)
        summary[name] = {
            "bubble": bubble,
            "to_analytic": bubble / analytic,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in found),
        }
        print(
            f"{name}: bubble {bubble:.3f} = {bubble / analytic:.2f} x the analytic {analytic:.3f}"
        )
    write_results(
        "models",
        {"machine": machine(), "command": " ".join(sys.argv), "runs": runs, "summary": summary},
    )


if __name__ == "__main__":
    main()
