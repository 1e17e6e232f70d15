"""Sharded replicas against whole ones: D = 2 x K = 1 on the GPT, ``Pipeline(shard="full")``
(PyTorch's fully_shard over the two replicas) beside ``Pipeline(data_parallel=2)``, the same
global batch, AdamW, side by side; then the planner's and the simulator's predictions.

1. Two processes (one thread each) hold both contenders at once. Each cycle runs one step
   of each (the pipeline's step and the optimizer's), in alternating order; the step time is
   the slower rank's, and the ratio is taken per cycle.
2. Memory per process: the bytes held between steps by parameters, gradients and optimizer
   state (a shard counted by its local part), measured after a step and set beside the
   planner's ``held_bytes``; and peak resident memory, each contender alone in fresh
   processes.
3. The simulator fed the measured per-layer costs, the link and the collectives' bandwidth
   predicts both step times.

    python -m benchmarks.bench_sharding            # ~5 minutes on 2 cores
    python -m benchmarks.bench_sharding --quick    # small sizes, to check that it runs
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
from gpipe.planning import Costs, plan
from gpipe.planning.memory import profile
from gpipe.planning.simulate import simulate
from gpipe.schedules import gpipe

from .bench_scaling import _layer_costs, _link, _stage_costs
from .common import gpt_model, machine, quick_or_repeats, write_results

NAMES = ("whole", "sharded")
KEYS = ("seconds", "pipeline")
LINK = ("latency", "bandwidth", "allreduce", "gather", "grad_bytes")


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _contender(config: GPTConfig, chunks: int, name: str) -> tuple[Pipeline, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same weights in both
    shard_ = "full" if name == "sharded" else None
    pipe = Pipeline(
        build_gpt(config),
        [config.n_layer + 2],
        chunks=chunks,
        checkpoint="never",
        loss_fn=lm_loss,
        data_parallel=2,
        shard=shard_,
    )
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-4)


def _step(pipe: Pipeline, optimizer: torch.optim.Optimizer, x, y) -> dict[str, float]:
    """One training step of this replica's half: the slower rank's seconds in all, and of the
    pipeline's step alone (what the simulator predicts; the optimizer's step is outside it)."""
    assert pipe.replicas is not None
    x, y = shard(x, pipe.replicas.replica, 2), shard(y, pipe.replicas.replica, 2)
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    start = perf_counter()
    pipe.step(x, y)
    stepped = perf_counter()
    optimizer.step()
    took = torch.tensor([perf_counter() - start, stepped - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return {"seconds": float(took[0]), "pipeline": float(took[1])}


def held_bytes(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This process's bytes of parameters, gradients and optimizer state, shards counted by
    their local part."""
    params = sum(_local(p).nbytes for p in pipe.parameters())
    grads = sum(_local(p.grad).nbytes for p in pipe.parameters() if p.grad is not None)
    states = sum(
        _local(v).nbytes
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {"params": params, "grads": grads, "optimizer": states}


def _tokens(config: GPTConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def side_by_side(cfg: dict) -> dict:
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    config = GPTConfig(**cfg["model"])
    contenders = {name: _contender(config, cfg["chunks"], name) for name in NAMES}
    x, y = _tokens(config, cfg["batch"])
    for pipe, optimizer in contenders.values():
        for _ in range(2):
            _step(pipe, optimizer, x, y)
    cycles = []
    for cycle in range(cfg["repeats"]):
        order = NAMES if cycle % 2 == 0 else NAMES[::-1]
        cycles.append({name: _step(*contenders[name], x, y) for name in order})
    held = {name: held_bytes(*contenders[name]) for name in NAMES}
    dist.barrier()
    rows = cfg["batch"] // 2 // cfg["chunks"]
    costs = _layer_costs(config, rows, cfg["repeats"])
    latency, bandwidth = _link(cfg["repeats"], rows * config.seq_len * config.d_model * 4)
    grads = sum(p.numel() * 4 for p in contenders["whole"][0].parameters())
    flat = torch.zeros(grads // 4)
    dist.barrier()
    start = perf_counter()
    dist.all_reduce(flat, group=contenders["whole"][0].replicas.group)  # type: ignore[union-attr]
    allreduce = perf_counter() - start
    return {"cycles": cycles, "held": held, "costs": costs, "latency": latency,
            "bandwidth": bandwidth, "grad_bytes": grads, "allreduce": allreduce,
            "gather": _gather_alone(contenders["sharded"][0])}  # fmt: skip


def _gather_alone(pipe: Pipeline) -> float:
    """Seconds of gathering every unit of the sharded stage through fully_shard, alone: what
    its collectives cost on this machine, with their copies in and out."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in pipe.modules() if isinstance(m, FSDPModule)]
    dist.barrier()
    start = perf_counter()
    for unit in units:
        unit.unshard()
    took = perf_counter() - start
    for unit in units:
        unit.reshard()
    return took


def peak_memory(cfg: dict, name: str) -> int:
    """One contender alone in fresh processes: peak resident bytes after a few steps."""
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    config = GPTConfig(**cfg["model"])
    pipe, optimizer = _contender(config, cfg["chunks"], name)
    x, y = _tokens(config, cfg["batch"])
    for _ in range(3):
        _step(pipe, optimizer, x, y)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def planned(cfg: dict) -> dict[str, float]:
    """The planner's bytes held between steps per process, whole and sharded."""
    config = GPTConfig(**cfg["model"])
    model = build_gpt(config, device="meta")
    rows = cfg["batch"] // 2 // cfg["chunks"]
    tokens = torch.zeros(rows, config.seq_len, dtype=torch.long, device="meta")
    prof = profile(model, tokens, target=tokens, loss_fn=lm_loss)
    out = {}
    for name, shard_ in (("whole", None), ("sharded", "full")):
        found = plan(
            prof,
            [len(model)],
            batch_size=cfg["batch"],
            chunks=cfg["chunks"],
            checkpoint="never",
            data_parallel=2,
            shard=shard_,
        )
        out[name] = found.ranks[0].held_bytes
    return out


def _bandwidth(found: dict, name: str) -> float:
    """The collectives' bandwidth as the simulator counts it, from what was measured alone: a
    ring all-reduce of B bytes over 2 ranks is charged B / bandwidth, a gather B / 2."""
    if name == "whole":
        return found["grad_bytes"] / max(found["allreduce"], 1e-9)
    return found["grad_bytes"] / 2 / max(found["gather"], 1e-9)


def predicted(found: dict, cfg: dict, name: str) -> float:
    """The simulator's step for one contender, from the measured costs."""
    config = GPTConfig(**cfg["model"])
    rows = cfg["batch"] // 2 // cfg["chunks"]
    f, b = _stage_costs(found["costs"], config.n_layer, 1)
    costs = Costs(
        forward=f,
        backward=b,
        latency=found["latency"],
        bandwidth=found["bandwidth"],
        message_bytes=rows * config.seq_len * config.d_model * 4,
        grad_bytes=[found["grad_bytes"]],
        allreduce_bandwidth=_bandwidth(found, name),
    )
    shard_ = "full" if name == "sharded" else None
    return simulate(gpipe(1, cfg["chunks"]), costs, data_parallel=2, shard=shard_).makespan


def main() -> None:
    args = quick_or_repeats(__doc__, repeats=9)
    model = gpt_model(args.quick)
    cfg = {"model": model, "batch": 32, "chunks": 4, "repeats": args.repeats}
    found = launch(side_by_side, 2, (cfg,), threads=1)
    cycles = found[0]["cycles"]
    median = {
        name: {key: statistics.median(c[name][key] for c in cycles) for key in KEYS}
        for name in NAMES
    }
    ratios = [c["sharded"]["seconds"] / c["whole"]["seconds"] for c in cycles]
    held = {name: [sum(r["held"][name].values()) for r in found.values()] for name in NAMES}
    peaks = {name: list(launch(peak_memory, 2, (cfg, name), threads=1).values()) for name in NAMES}
    plans = planned(cfg)
    sims = {name: predicted(found[0], cfg, name) for name in NAMES}
    print(f"{cfg['batch']} sequences of {model['seq_len']} tokens, {cfg['chunks']} micro-batches")
    for name in NAMES:
        print(
            f"{name}: step {median[name]['seconds'] * 1e3:.0f} ms, of which the pipeline's "
            f"{median[name]['pipeline'] * 1e3:.0f} ms (simulated {sims[name] * 1e3:.0f} ms, "
            f"measured / simulated {median[name]['pipeline'] / sims[name]:.2f}); held between "
            f"steps {max(held[name]) / 2**20:.1f} MiB per process (planned "
            f"{plans[name] / 2**20:.1f}, "
            f"measured / planned {max(held[name]) / plans[name]:.3f}); peak resident "
            f"{max(peaks[name]) / 2**20:.0f} MiB"
        )
    print(
        f"sharded / whole step, per cycle: median {statistics.median(ratios):.3f} (min "
        f"{min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} cycles); held bytes "
        f"sharded / whole {max(held['sharded']) / max(held['whole']):.3f}"
    )
    write_results(
        "sharding-quick" if args.quick else "sharding",
        {
            "machine": machine(),
            "workload": cfg,
            "median": median,
            "ratio_per_cycle": ratios,
            "held": held,
            "held_parts": [r["held"] for r in found.values()],
            "planned": plans,
            "simulated": sims,
            "peak_resident": peaks,
            "link": {k: found[0][k] for k in LINK},
        },
    )


if __name__ == "__main__":
    main()
