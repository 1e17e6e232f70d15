"""Two replicas or two stages: D = 2 x K = 1 against K = 2 x D = 1 on the GPT, the same global
batch, side by side; then the simulator, fed the measured costs, for D x K up to 8 x 16.

1. Two processes (one thread each) hold both contenders at once: the model replicated
   (``Pipeline(data_parallel=2)``, each replica half the batch) and the model cut in two
   (``Pipeline`` over 2 stages, the whole batch), micro-batches of the same size. Each cycle
   runs one step of each, in alternating order; the step time is the slower rank's, and
   the ratio is taken per cycle. Each replica's stage reports how long it waited for the
   gradients' sums after its last backward (what the overlap left exposed), and each cycle
   also times the same all-reduce alone: the difference is what the overlap hid. A third
   contender replicates with the whole stage in one bucket, which cannot start before the
   backward ends: against it, what the default buckets buy.
2. Peak memory per process: each contender alone, in fresh processes, a few steps.
3. Costs for the simulator: the embedding, a block and the head timed forward and backward
   at the micro-batch size, both processes at once; the link's latency and bandwidth; the
   all-reduce's bandwidth. The simulator predicts both measured cases, and the step time
   of D x K pipelines of a 32-block GPT on a global batch of 512 sequences.

    python -m benchmarks.bench_data_parallel            # ~10 minutes on 2 cores
    python -m benchmarks.bench_data_parallel --quick    # small sizes, to check that it runs
"""

from __future__ import annotations

import resource
import statistics
from time import perf_counter

import torch
import torch.distributed as dist

from gpipe import Pipeline, launch
from gpipe.models import GPTConfig, build_gpt, lm_loss
from gpipe.parallel import shard
from gpipe.planning import Costs
from gpipe.planning.simulate import simulate
from gpipe.schedules import gpipe

from .bench_scaling import _layer_costs, _link, _stage_costs
from .common import gpt_model, machine, quick_or_repeats, timed_step, write_results

DS = (1, 2, 4, 8)
ONE_BUCKET = "D=2 x K=1, one bucket"
KS = (1, 2, 4, 8, 16)


def _contenders(config: GPTConfig, rows: int, batch: int) -> dict[str, Pipeline]:
    """Both ways of using 2 processes, micro-batches of ``rows`` sequences each."""
    layers = config.n_layer + 2

    def built(balance: list[int], chunks: int, **options) -> Pipeline:
        torch.manual_seed(0)  # the same weights in every contender
        model = build_gpt(config)
        return Pipeline(
            model, balance, chunks=chunks, checkpoint="never", loss_fn=lm_loss, **options
        )

    replicated = built([layers], batch // 2 // rows, data_parallel=2)
    one_bucket = built([layers], batch // 2 // rows, data_parallel=2, bucket_bytes=2**40)
    staged = built([layers - layers // 2, layers // 2], batch // rows)
    return {"D=2 x K=1": replicated, "K=2 x D=1": staged, ONE_BUCKET: one_bucket}


def _step(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One step; the slower rank's seconds, and the pipeline's own bubble and wait."""
    if pipe.replicas is not None:
        x, y = shard(x, pipe.replicas.replica, 2), shard(y, pipe.replicas.replica, 2)
    took = timed_step(pipe, x, y)
    times = pipe.last_step
    assert times is not None
    return {
        "seconds": took,
        "bubble": times.idle_fraction,
        "allreduce_wait": times.allreduce_wait,
        "buckets": times.allreduce_buckets,
        "early": times.allreduce_early,
    }


def _allreduce_alone(pipe: Pipeline) -> float:
    """Seconds of the replicas' gradient all-reduce run alone, in the same buckets."""
    assert pipe.replicas is not None
    buckets = next(iter(pipe.runner.buckets.values())).buckets
    flats = [torch.cat([p.detach().reshape(-1) for p in b.params]) for b in buckets]
    dist.barrier()
    start = perf_counter()
    works = [dist.all_reduce(f, group=pipe.replicas.group, async_op=True) for f in flats]
    for work in works:
        work.wait()
    return perf_counter() - start


def side_by_side(cfg: dict) -> dict:
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    config = GPTConfig(**cfg["model"])
    contenders = _contenders(config, cfg["rows"], cfg["batch"])
    generator = torch.Generator().manual_seed(1)
    shape = (cfg["batch"], config.seq_len + 1)
    tokens = torch.randint(0, config.vocab_size, shape, generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for pipe in contenders.values():
        for _ in range(2):
            _step(pipe, x, y)
    cycles = []
    names = list(contenders)
    for cycle in range(cfg["repeats"]):
        order = names if cycle % 2 == 0 else names[::-1]
        found = {name: _step(contenders[name], x, y) for name in order}
        found["allreduce_alone"] = _allreduce_alone(contenders["D=2 x K=1"])
        found["one_bucket_alone"] = _allreduce_alone(contenders[ONE_BUCKET])
        cycles.append(found)
    # costs for the simulator, both processes at once: contended, as in the runs above
    dist.barrier()
    costs = _layer_costs(config, cfg["rows"], cfg["repeats"])
    message = cfg["rows"] * config.seq_len * config.d_model * 4
    latency, bandwidth = _link(cfg["repeats"], message)
    grads = sum(p.numel() * 4 for p in contenders["D=2 x K=1"].parameters())
    return {
        "cycles": cycles,
        "costs": costs,
        "latency": latency,
        "bandwidth": bandwidth,
        "grad_bytes": grads,
    }


def peak_memory(cfg: dict, name: str) -> dict:
    """One contender alone in fresh processes: resident memory before and after its steps."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    config = GPTConfig(**cfg["model"])
    pipe = _contenders(config, cfg["rows"], cfg["batch"])[name]
    tokens = torch.randint(0, config.vocab_size, (cfg["batch"], config.seq_len + 1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(3):
        _step(pipe, tokens[:, :-1], tokens[:, 1:])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"before": before, "peak": after}


def _per_stage_grad_bytes(config: GPTConfig, blocks: int, k: int) -> list[float]:
    """Gradient bytes per stage of a ``blocks``-deep GPT cut evenly, ends on the ends."""
    model = build_gpt(GPTConfig(**{**config.__dict__, "n_layer": 1}), device="meta")
    sizes = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model]
    per, extra = divmod(blocks, k)
    counts = [per + (1 if s < extra else 0) for s in range(k)]
    out = [n * sizes[1] for n in counts]
    out[0] += sizes[0]
    out[-1] += sizes[-1]
    return out


def predict(
    found: dict, config: GPTConfig, blocks: int, d: int, k: int, batch: int, rows: int
) -> dict[str, float]:
    """The simulator's step for D replicas of a K-stage pipeline on ``batch`` sequences in
    micro-batches of ``rows``."""
    m = max(1, batch // d // rows)
    f, b = _stage_costs(found["costs"], blocks, k)
    costs = Costs(
        forward=f,
        backward=b,
        latency=found["latency"],
        bandwidth=found["bandwidth"],
        message_bytes=rows * config.seq_len * config.d_model * 4,
        grad_bytes=_per_stage_grad_bytes(config, blocks, k),
        allreduce_bandwidth=found["allreduce_bandwidth"],
    )
    result = simulate(gpipe(k, m), costs, data_parallel=d)
    return {
        "seconds": result.makespan,
        "bubble": result.bubble,
        "allreduce_exposed": max(result.allreduce_exposed, default=0.0),
    }


def main() -> None:
    args = quick_or_repeats(__doc__, repeats=9)
    model = gpt_model(args.quick)
    cfg = {"model": model, "batch": 32, "rows": 4, "repeats": args.repeats}
    config = GPTConfig(**model)
    found = launch(side_by_side, 2, (cfg,), threads=1)[0]
    memory = {
        name: launch(peak_memory, 2, (cfg, name), threads=1) for name in ("D=2 x K=1", "K=2 x D=1")
    }
    cycles = found["cycles"]
    names = ("D=2 x K=1", "K=2 x D=1")
    median = {
        name: {
            key: statistics.median(c[name][key] for c in cycles)
            for key in ("seconds", "bubble", "allreduce_wait", "buckets", "early")
        }
        for name in (*names, ONE_BUCKET)
    }
    ratios = [c[names[0]]["seconds"] / c[names[1]]["seconds"] for c in cycles]
    alone = statistics.median(c["allreduce_alone"] for c in cycles)
    exposed = median[names[0]]["allreduce_wait"]
    found["allreduce_bandwidth"] = found["grad_bytes"] / max(alone, 1e-9)  # ring, D = 2: x 1
    print(f"{cfg['batch']} sequences of {model['seq_len']} tokens, micro-batches of {cfg['rows']}")
    for name in names:
        peak = max(r["peak"] for r in memory[name].values())
        print(
            f"{name}: step {median[name]['seconds'] * 1e3:.0f} ms, bubble "
            f"{median[name]['bubble']:.1%}, peak resident memory {peak / 2**20:.0f} MiB per "
            "process"
        )
    print(
        f"D=2 x K=1 / K=2 x D=1, per cycle: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} cycles)"
    )
    for name, key in ((names[0], "allreduce_alone"), (ONE_BUCKET, "one_bucket_alone")):
        took = statistics.median(c[key] for c in cycles)
        waited = median[name]["allreduce_wait"]
        print(
            f"{name}: all-reduce in {median[name]['buckets']:.0f} bucket(s), "
            f"{median[name]['early']:.0f} started during the last backward: {took * 1e3:.1f} ms "
            f"alone, {waited * 1e3:.1f} ms exposed after the last backward, "
            f"{max(0.0, took - waited) * 1e3:.1f} ms ({max(0.0, 1 - waited / took):.0%}) hidden"
        )
    buckets = [c[names[0]]["seconds"] / c[ONE_BUCKET]["seconds"] for c in cycles]
    print(
        f"{names[0]} / {ONE_BUCKET}, per cycle: median {statistics.median(buckets):.3f} "
        f"(min {min(buckets):.3f}, max {max(buckets):.3f})"
    )
    checks = {}
    for name, d, k in (("D=2 x K=1", 2, 1), ("K=2 x D=1", 1, 2)):
        predicted = predict(found, config, model["n_layer"], d, k, cfg["batch"], cfg["rows"])
        checks[name] = {"measured": median[name]["seconds"], **predicted}
        print(
            f"{name}: measured {median[name]['seconds'] * 1e3:.0f} ms, simulated "
            f"{predicted['seconds'] * 1e3:.0f} ms, measured / simulated "
            f"{median[name]['seconds'] / predicted['seconds']:.2f}"
        )
    blocks, batch = 32, 512
    table = {
        d: {k: predict(found, config, blocks, d, k, batch, cfg["rows"]) for k in KS} for d in DS
    }
    base = table[1][1]["seconds"]
    print(f"simulated speed-up over D=1 x K=1 ({blocks} blocks, {batch} sequences per step):")
    print("D \\ K " + "".join(f"{k:>8d}" for k in KS))
    for d, row in table.items():
        print(f"{d:5d} " + "".join(f"{base / row[k]['seconds']:8.2f}" for k in KS))
    report = {
        "machine": machine(),
        "workload": cfg,
        "median": median,
        "ratio_per_cycle": ratios,
        "allreduce": {
            "alone": alone,
            "exposed": exposed,
            "one_bucket_alone": statistics.median(c["one_bucket_alone"] for c in cycles),
            "one_bucket_exposed": median[ONE_BUCKET]["allreduce_wait"],
            "default_over_one_bucket_per_cycle": buckets,
        },
        "memory": memory,
        "checks": checks,
        "table": table,
        "link": {k: found[k] for k in ("latency", "bandwidth", "allreduce_bandwidth")},
        "costs": found["costs"],
    }
    path = write_results("data-parallel-quick" if args.quick else "data-parallel", report)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
