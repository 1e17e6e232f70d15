"""Memory against time for finer re-materialization: ``Layers(every=k)`` on the GPT.

Two processes (K = 2, one thread each) train the same GPT under "never", ``Layers(every=4)``,
``Layers(every=2)``, ``Layers(every=1)`` (every layer recomputed, its input kept) and
"always" (each stage recomputed whole, only its input kept). Each cycle runs one step of
every policy, in rotating order; the step times are the slower rank's, and each policy's
time is also taken per cycle as a ratio to "never". Then one step of each under the
activation meter gives the peak activation bytes per process, beside the planner's
prediction for the same policy.

    python -m benchmarks.bench_layers            # ~5 minutes on 2 cores
    python -m benchmarks.bench_layers --quick    # small sizes, to check that it runs
"""

from __future__ import annotations

import statistics

import torch

from gpipe import Pipeline, launch
from gpipe.models import GPTConfig, build_gpt, lm_loss
from gpipe.planning import ActivationMeter, plan
from gpipe.planning.memory import profile
from gpipe.runtime import Layers

from .common import gpt_model, machine, quick_or_repeats, timed_step, write_results

POLICIES = {
    "never": "never",
    "every 4": Layers(every=4),
    "every 2": Layers(every=2),
    "every 1": Layers(every=1),
    "always": "always",
}


def run(cfg: dict) -> dict:
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    config = GPTConfig(**cfg["model"])
    layers = config.n_layer + 2
    balance = [layers - layers // 2, layers // 2]
    pipes = {}
    for name, policy in POLICIES.items():
        torch.manual_seed(0)
        pipes[name] = Pipeline(
            build_gpt(config), balance, chunks=cfg["chunks"], checkpoint=policy, loss_fn=lm_loss
        )
    generator = torch.Generator().manual_seed(1)
    shape = (cfg["batch"], config.seq_len + 1)
    tokens = torch.randint(0, config.vocab_size, shape, generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]

    for pipe in pipes.values():
        timed_step(pipe, x, y)
    names = list(pipes)
    cycles = []
    for cycle in range(cfg["repeats"]):
        shift = cycle % len(names)
        order = names[shift:] + names[:shift]
        cycles.append({name: timed_step(pipes[name], x, y) for name in order})
    peaks = {}
    for name, pipe in pipes.items():
        with ActivationMeter(pipe) as meter:
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        peaks[name] = meter.peak
    return {"cycles": cycles, "peaks": peaks, "balance": balance}


def predicted(cfg: dict, balance: list[int]) -> dict[str, list[float]]:
    """The planner's activation bytes per process for each policy, from a meta profile."""
    config = GPTConfig(**cfg["model"])
    model = build_gpt(config, device="meta")
    rows = cfg["batch"] // cfg["chunks"]
    tokens = torch.zeros(rows, config.seq_len, dtype=torch.long, device="meta")
    prof = profile(model, tokens, target=tokens, loss_fn=lm_loss)
    return {
        name: [
            r.activation_bytes
            for r in plan(
                prof,
                balance,
                batch_size=cfg["batch"],
                chunks=cfg["chunks"],
                checkpoint=policy,
                layers=model,
            ).ranks
        ]
        for name, policy in POLICIES.items()
    }


def main() -> None:
    args = quick_or_repeats(__doc__, repeats=9)
    model = gpt_model(args.quick)
    cfg = {"model": model, "batch": 32, "chunks": 8, "repeats": args.repeats}
    found = launch(run, 2, (cfg,), threads=1)
    cycles = found[0]["cycles"]
    plans = predicted(cfg, found[0]["balance"])
    rows = {}
    print(
        f"GPT {model['n_layer']} blocks, d_model {model['d_model']}, K = 2, "
        f"{cfg['chunks']} micro-batches of {cfg['batch'] // cfg['chunks']}"
    )
    print(
        f"{'policy':>10} {'step ms':>8} {'/ never':>8} {'peak MiB (rank 0, 1)':>22} "
        f"{'planned MiB':>14}"
    )
    for name in POLICIES:
        seconds = statistics.median(c[name] for c in cycles)
        ratio = statistics.median(c[name] / c["never"] for c in cycles)
        peaks = [found[r]["peaks"][name] for r in sorted(found)]
        rows[name] = {"seconds": seconds, "ratio": ratio, "peaks": peaks, "planned": plans[name]}
        shown = ", ".join(f"{p / 2**20:.1f}" for p in peaks)
        planned = ", ".join(f"{p / 2**20:.1f}" for p in plans[name])
        print(f"{name:>10} {seconds * 1e3:8.0f} {ratio:8.3f} {shown:>22} {planned:>14}")
    path = write_results(
        "layers-quick" if args.quick else "layers",
        {"machine": machine(), "workload": cfg, "policies": rows},
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
