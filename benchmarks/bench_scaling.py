"""Speed-up against the number of stages K and of micro-batches M, as in the paper's Table 2,
predicted by the simulator from a GPT's measured layer costs and this machine's measured link,
with the K = 2 prediction checked against real runs.

1. Two processes (one thread each) time a GPT block, the embedding and the head, forward and
   backward apart, at every micro-batch size the table needs, both at once: costs as a
   process sees them while the other one computes too.
2. They time the link between them: a small message's one-way latency and a large one's
   bandwidth, through gpipe's transport.
3. They run gpipe.Pipeline, K = 2, on the GPT for several M and record the step times.
4. The simulator predicts the GPipe schedule's step for K = 1..16 on a GPT deep enough to
   cut 16 ways (the block's costs repeated), and for the measured model at K = 2.

    python -m benchmarks.bench_scaling            # ~10 minutes on 2 cores
    python -m benchmarks.bench_scaling --quick    # small sizes, to check that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from time import perf_counter

import torch
import torch.distributed as dist

from gpipe import Pipeline, launch
from gpipe.models import GPTConfig, build_gpt, lm_loss
from gpipe.planning import PassCosts, pipeline_costs, stage_costs
from gpipe.planning.simulate import simulate
from gpipe.schedules import gpipe

from .common import gpt_model, machine, write_results

KS = (1, 2, 4, 8, 16)
MS = (1, 2, 4, 8, 16, 32)


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = perf_counter()
        fn()
        times.append(perf_counter() - start)
    return statistics.median(times)


def _layer_costs(config: GPTConfig, rows: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Forward and backward seconds of the embedding, one block and the head on ``rows``."""
    model = build_gpt(config)
    tokens = torch.randint(0, config.vocab_size, (rows, config.seq_len))
    target = torch.randint(0, config.vocab_size, (rows, config.seq_len))
    out: dict[str, tuple[float, float]] = {}
    x: torch.Tensor = tokens
    for name, layer in (("embedding", model[0]), ("block", model[1]), ("head", model[-1])):
        inp = x.detach().requires_grad_(x.is_floating_point())
        y = layer(inp)
        grad = None if name == "head" else torch.ones_like(y)

        def both(layer=layer, inp=inp, grad=grad) -> None:
            out = layer(inp)
            if grad is None:
                lm_loss(out, target).backward()
            else:
                out.backward(grad)

        forward = _median_time(lambda layer=layer, inp=inp: layer(inp), repeats)
        out[name] = (forward, max(_median_time(both, repeats) - forward, 0.0))
        x = y.detach()
    return out


def _link(repeats: int, big: int) -> tuple[float, float]:
    """One-way seconds of a small message, and bytes per second of a large one, rank 0 <-> 1,
    through the transport a Pipeline uses (pipes on one machine)."""
    from gpipe.comm import DistributedTransport, open_pipes
    from gpipe.schedules import Kind

    transport = DistributedTransport([0, 1], torch.device("cpu"))
    receives, sends = transport.channels([dist.get_rank()], ())
    transport.use_pipes(open_pipes(receives, sends, None))
    me = dist.get_rank()

    def round_trips(message: torch.Tensor, n: int) -> float:
        dist.barrier()
        start = perf_counter()
        for i in range(n):
            if me == 0:
                transport.send(message, 0, 1, i, Kind.SEND_F)
                transport.recv(1, 0, i, Kind.RECV_B)
            else:
                got = transport.recv(0, 1, i, Kind.RECV_F)
                transport.send(got, 1, 0, i, Kind.SEND_B)
        transport.flush()
        return (perf_counter() - start) / (2 * n)

    latency = round_trips(torch.zeros(8), repeats * 20)
    large = round_trips(torch.zeros(big // 4), repeats)
    return latency, big / max(large - latency, 1e-9)


def _pipeline_steps(config: GPTConfig, batch: int, chunks: tuple[int, ...], repeats: int) -> dict:
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    layers = config.n_layer + 2
    balance = [layers - layers // 2, layers // 2]
    out = {}
    for m in chunks:
        pipe = Pipeline(build_gpt(config), balance, chunks=m, checkpoint="never", loss_fn=lm_loss)

        def step(pipe=pipe):
            pipe.zero_grad()
            pipe.step(x, y)

        for _ in range(2):
            step()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = perf_counter()
            step()
            times.append(perf_counter() - start)
        out[m] = statistics.median(times)
    return out


def run(cfg: dict) -> dict:
    from gpipe.comm import init_process_group

    init_process_group(torch.device("cpu"))
    torch.manual_seed(0)
    config = GPTConfig(**cfg["model"])
    costs = {}
    for _ in range(2):  # the first pass warms the process up; the second is kept
        for m in MS:
            rows = cfg["batch"] // m
            if rows >= 1:
                dist.barrier()  # both processes time at once: contended costs
                costs[rows] = _layer_costs(config, rows, cfg["repeats"])
    message = cfg["batch"] * config.seq_len * config.d_model * 4
    latency, bandwidth = _link(cfg["repeats"], message)
    steps = _pipeline_steps(config, cfg["batch"], cfg["check_chunks"], cfg["repeats"])
    return {"costs": costs, "latency": latency, "bandwidth": bandwidth, "steps": steps}


def _stage_costs(layer: dict[str, tuple[float, float]], blocks: int, k: int) -> list[PassCosts]:
    """Per stage, forward and backward seconds: blocks spread evenly, embedding and head on the
    ends, assembled as the cluster planner assembles a stage from its layers."""
    per, extra = divmod(blocks, k)
    counts = [per + (1 if s < extra else 0) for s in range(k)]

    def timed(name: str) -> PassCosts:
        forward, backward = layer[name]
        return PassCosts(forward=forward, backward=backward)

    return stage_costs(timed("embedding"), timed("block"), timed("head"), counts)


def predict(costs: dict, latency: float, bandwidth: float, blocks: int, k: int, m: int,
            batch: int, bytes_per_row: int) -> float:  # fmt: skip
    """The simulated step of the GPipe schedule, K stages, M micro-batches, from the layers'
    measured costs and the measured link (``gpipe.planning.cluster_step``'s assembly)."""
    message = batch // m * bytes_per_row
    stages = _stage_costs(costs[batch // m], blocks, k)
    c = pipeline_costs(
        stages, message_bytes=message, latency=latency, transfer=latency + message / bandwidth
    )
    return simulate(gpipe(k, m), c).makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = gpt_model(args.quick)
    batch, deep = 32, 32  # the table's model: 32 blocks, so that 16 stages get 2 each
    cfg = {"model": model, "batch": batch, "repeats": args.repeats, "check_chunks": (1, 2, 4, 8)}
    per_rank = launch(run, 2, (cfg,), threads=1)
    got = per_rank[0]
    costs = {int(r): c for r, c in got["costs"].items()}
    latency, bandwidth = got["latency"], got["bandwidth"]
    bytes_per_row = model["seq_len"] * model["d_model"] * 4
    base = predict(costs, latency, bandwidth, deep, 1, 1, batch, bytes_per_row)

    def speedup(k: int, m: int) -> float:
        return base / predict(costs, latency, bandwidth, deep, k, m, batch, bytes_per_row)

    table = {k: {m: speedup(k, m) for m in MS if batch // m >= 1} for k in KS}
    print(f"link: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s")
    print(f"speed-up over K=1, M=1 (GPipe, {deep} blocks, batch {batch}), simulated:")
    print("K \\ M " + "".join(f"{m:>8d}" for m in MS))
    for k, row in table.items():
        print(f"{k:5d} " + "".join(f"{row[m]:8.2f}" for m in MS))
    check = {}
    measured = {int(m): max(r["steps"][m] for r in per_rank.values()) for m in got["steps"]}
    for m, seconds in measured.items():
        predicted = predict(costs, latency, bandwidth, model["n_layer"], 2, m, batch, bytes_per_row)
        check[m] = {"measured": seconds, "predicted": predicted, "ratio": seconds / predicted}
        print(
            f"K=2, M={m}: measured {seconds:.3f} s, predicted {predicted:.3f} s, "
            f"measured / predicted {seconds / predicted:.3f}"
        )
    report = {
        "machine": machine(),
        "workload": cfg,
        "link": {"latency": latency, "bandwidth": bandwidth},
        "costs": costs,
        "speedup": table,
        "k2_check": check,
    }
    path = write_results("scaling-quick" if args.quick else "scaling", report)
    print(f"written to {path}")
    json.dumps(report)


if __name__ == "__main__":
    main()
