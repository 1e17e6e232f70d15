"""CUDA exactness, peak memory and step time of gpipe.Pipeline schedules, one process (K=1).

On a GPU machine: ``python benchmarks/gpu_check.py --device cuda:0 --json out.json``
(results of one H100 in benchmarks/results/gpu-h100/ and BENCHMARKS.md)."""

import argparse
import copy
import gc
import json
import os
import socket
import statistics
import sys
import time
import traceback

import torch
from torch import nn
from torch.nn.functional import mse_loss

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--width", type=int, default=4096)
p.add_argument("--batches", default="512,8192")
p.add_argument("--time-chunks", default="4,8,16")
p.add_argument("--time-batch", type=int, default=512)
p.add_argument("--steps", type=int, default=9)
p.add_argument("--skip", default="")  # comma list of parts to skip: exact,memory,timing
p.add_argument("--json", default="")
args = p.parse_args()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(
    RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
)

from gpipe import Pipeline  # noqa: E402
from gpipe.schedules import SCHEDULES  # noqa: E402

dev = torch.device(args.device)
cuda = dev.type == "cuda"
ALL = [
    "gpipe",
    "1f1b",
    "zero-bubble",
    "interleaved",
    "interleaved-zero-bubble",
    "looped-bfs",
    "zero-bubble-v",
    "dualpipe-v",
]
print("registered schedules:", list(SCHEDULES), flush=True)
if cuda:
    print("device:", torch.cuda.get_device_name(dev), "torch", torch.__version__, flush=True)
report = {"exact": [], "memory": [], "timing": []}
skip = set(args.skip.split(",")) if args.skip else set()


def balances(schedule, n_layers):
    """Balances tried for one process: one stage, a V of two, looped 2 and 4 stages."""
    if schedule in ("gpipe", "1f1b", "zero-bubble"):
        return [[n_layers]]
    if schedule in ("zero-bubble-v", "dualpipe-v"):
        return [[n_layers // 2] * 2]
    return [[n_layers // 2] * 2, [n_layers // 4] * 4]


def sync():
    if cuda:
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------- 1. exactness, float64
def small_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 16),
        nn.Linear(16, 4),
    ).double()


def exact():
    g = torch.Generator().manual_seed(1)
    for schedule in ALL:
        for balance in balances(schedule, 8):
            for chunks in (2, 4, 8):
                for mode in ("never", "always", "except_last"):
                    case = dict(schedule=schedule, balance=balance, chunks=chunks, mode=mode)
                    try:
                        ref = small_mlp().to(dev)
                        pipe = Pipeline(
                            copy.deepcopy(small_mlp()),
                            balance,
                            chunks=chunks,
                            checkpoint=mode,
                            schedule=schedule,
                            loss_fn=mse_loss,
                            device=dev,
                        )
                        worst = 0.0
                        for _step in range(2):  # two steps: gradients accumulate
                            rows = 2 * chunks - 1
                            x = torch.randn(rows, 6, dtype=torch.float64, generator=g)
                            y = torch.randn(rows, 4, dtype=torch.float64, generator=g)
                            loss = pipe.step(x, y)
                            ref_loss = mse_loss(ref(x.to(dev)), y.to(dev))
                            ref_loss.backward()
                            torch.testing.assert_close(loss.to(dev).double(), ref_loss.detach())
                            worst = max(worst, (loss.to(dev) - ref_loss).abs().item())
                            refp = dict(ref.named_parameters())
                            names = 0
                            for name, prm in pipe.named_parameters():
                                assert prm.device.type == dev.type, (name, prm.device)
                                torch.testing.assert_close(prm.grad, refp[name].grad)
                                worst = max(worst, (prm.grad - refp[name].grad).abs().max().item())
                                names += 1
                            assert names == len(refp), (names, len(refp))
                        with torch.no_grad():
                            out = pipe(x)
                            torch.testing.assert_close(out, ref(x.to(dev)))
                            torch.testing.assert_close(
                                pipe.evaluate(x, y).to(dev).double(),
                                mse_loss(ref(x.to(dev)), y.to(dev)),
                            )
                        case.update(ok=True, max_abs_diff=worst)
                    except Exception as exc:
                        case.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:600])
                        traceback.print_exc()
                    report["exact"].append(case)
                    del_pipe()
    bad = [c for c in report["exact"] if not c["ok"]]
    by = {}
    for c in report["exact"]:
        s = by.setdefault(c["schedule"], [0, 0, 0.0])
        s[0] += c["ok"]
        s[1] += 1
        s[2] = max(s[2], c.get("max_abs_diff", 0.0))
    print("\n== exactness (float64, 2 steps each, loss+grads+forward+evaluate) ==")
    for k, (ok, n, w) in by.items():
        print(f"{k:26s} {ok}/{n} ok  max|diff|={w:.3g}")
    for c in bad:
        print("FAIL", c)
    sys.stdout.flush()


def del_pipe():
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- 2. memory, float32
def keep(rows, row, measure):
    """``row`` with ``measure()``'s figures (or its error), kept in ``rows`` and printed; the
    pipeline it built is freed before the next one."""
    try:
        row.update(measure())
    except Exception as exc:
        row.update(error=f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()
    rows.append(row)
    print(row, flush=True)
    del_pipe()


def big_mlp(width, n=8):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)])


def mib(b):
    return b / 2**20


def memory():
    width = args.width
    print(f"\n== peak memory, float32 MLP 8 x Linear({width},{width})+GELU, chunks 8 ==")
    for rows in [int(b) for b in args.batches.split(",")]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, width, generator=g)
        y = torch.randn(rows, width, generator=g)
        # un-pipelined reference, whole batch, and micro-batches with grad accumulation
        for label, chunks in (("unpipelined (1 batch)", 1), ("unpipelined (8 accum)", 8)):
            model = big_mlp(width).to(dev)
            xs, ys = x.to(dev), y.to(dev)
            for _it in range(2):
                model.zero_grad(set_to_none=False)
                sync()
                base = torch.cuda.memory_allocated(dev) if cuda else 0
                if cuda:
                    torch.cuda.reset_peak_memory_stats(dev)
                for xc, yc in zip(xs.chunk(chunks), ys.chunk(chunks), strict=False):
                    (mse_loss(model(xc), yc) * len(xc) / rows).backward()
                sync()
                peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
            row = dict(
                batch=rows,
                schedule=label,
                balance="-",
                mode="-",
                base_mib=mib(base),
                peak_mib=mib(peak),
                delta_mib=mib(peak - base),
            )
            report["memory"].append(row)
            print(row, flush=True)
            del model, xs, ys
            del_pipe()
        for mode in ("never", "except_last"):
            for schedule in ALL:
                for balance in balances(schedule, 8):
                    row = dict(batch=rows, schedule=schedule, balance=balance, mode=mode)

                    def measure(balance=balance, mode=mode, schedule=schedule, x=x, y=y):
                        pipe = Pipeline(
                            big_mlp(width),
                            balance,
                            chunks=8,
                            checkpoint=mode,
                            schedule=schedule,
                            loss_fn=mse_loss,
                            device=dev,
                        )
                        pipe.step(x, y)  # warm: grads allocated
                        pipe.zero_grad(set_to_none=False)
                        sync()
                        base = torch.cuda.memory_allocated(dev) if cuda else 0
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(dev)
                        pipe.step(x, y)
                        sync()
                        peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
                        return dict(
                            base_mib=mib(base), peak_mib=mib(peak), delta_mib=mib(peak - base)
                        )

                    keep(report["memory"], row, measure)
    print(
        "\n| batch | checkpoint | schedule | balance | weights+grads MiB | peak MiB "
        "| peak - base MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in report["memory"]:
        if "error" in r:
            print(
                f"| {r['batch']} | {r['mode']} | {r['schedule']} | {r['balance']} "
                f"| ERROR {r['error'][:80]} | | |"
            )
        else:
            print(
                f"| {r['batch']} | {r['mode']} | {r['schedule']} | {r['balance']} | "
                f"{r['base_mib']:.0f} | {r['peak_mib']:.0f} | {r['delta_mib']:.0f} |"
            )
    sys.stdout.flush()


# ---------------------------------------------------------------- 3. timing, float32
def timing():
    width, rows = args.width, args.time_batch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g)
    y = torch.randn(rows, width, generator=g)
    print(
        f"\n== step time, float32 MLP width {width}, batch {rows}, checkpoint never, "
        f"median of {args.steps} after 2 warm-ups ==",
        flush=True,
    )
    chunk_list = [int(c) for c in args.time_chunks.split(",")]
    model = big_mlp(width).to(dev)
    xs, ys = x.to(dev), y.to(dev)
    for chunks in chunk_list:
        ts = []
        for it in range(2 + args.steps):
            sync()
            t0 = time.perf_counter()
            for xc, yc in zip(xs.chunk(chunks), ys.chunk(chunks), strict=False):
                (mse_loss(model(xc), yc) * len(xc) / rows).backward()
            sync()
            if it >= 2:
                ts.append(time.perf_counter() - t0)
        row = dict(
            schedule="unpipelined accum",
            balance="-",
            chunks=chunks,
            median_ms=1e3 * statistics.median(ts),
            min_ms=1e3 * min(ts),
        )
        report["timing"].append(row)
        print(row, flush=True)
    del model, xs, ys
    del_pipe()
    for schedule in ALL:
        for balance in balances(schedule, 8):
            for chunks in chunk_list:
                row = dict(schedule=schedule, balance=balance, chunks=chunks)

                def measure(balance=balance, chunks=chunks, schedule=schedule, x=x, y=y):
                    pipe = Pipeline(
                        big_mlp(width),
                        balance,
                        chunks=chunks,
                        checkpoint="never",
                        schedule=schedule,
                        loss_fn=mse_loss,
                        device=dev,
                    )
                    ts = []
                    for it in range(2 + args.steps):
                        sync()
                        t0 = time.perf_counter()
                        pipe.step(x, y)
                        sync()
                        if it >= 2:
                            ts.append(time.perf_counter() - t0)
                    return dict(median_ms=1e3 * statistics.median(ts), min_ms=1e3 * min(ts))

                keep(report["timing"], row, measure)
    print("\n| schedule | balance | " + " | ".join(f"chunks {c} (ms)" for c in chunk_list) + " |")
    print("|---|---|" + "---|" * len(chunk_list))
    keyed = {}
    for r in report["timing"]:
        keyed.setdefault((r["schedule"], str(r["balance"])), {})[r["chunks"]] = r
    for (s, b), rs in keyed.items():
        cells = [
            f"{rs[c]['median_ms']:.2f}" if c in rs and "median_ms" in rs[c] else "ERR"
            for c in chunk_list
        ]
        print(f"| {s} | {b} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


t_all = time.time()
for name, fn in (("exact", exact), ("memory", memory), ("timing", timing)):
    if name in skip:
        continue
    t = time.time()
    fn()
    print(f"[{name} took {time.time() - t:.1f}s]", flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
print(f"[all took {time.time() - t_all:.1f}s]")
ok = all(c["ok"] for c in report["exact"])
print("EXACT_ALL_OK" if ok else "EXACT_FAILURES")
