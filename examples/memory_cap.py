"""A model too large for one process under a memory cap trains when pipelined over two.

The model has eight residual layers of width 2048 and a head: 33.6 M parameters, 128 MiB in
float32, and four times that with their gradients and Adam's two moments. Every run caps the
memory of each of its processes before it builds anything, then trains on the same
mini-batches from the same weights (built on the meta device, each layer initialized from
one seed and its index, as ``gpipe.Pipeline`` does):

1. without the pipeline, in one capped process: it runs out of memory;
2. pipelined in K = 2 capped processes, re-materializing every micro-batch (checkpoint
   "always"): each holds half the model, and it trains;
3. without the pipeline and without a cap: the reference, whose losses run 2 matches.

On CPU the cap is ``resource.setrlimit(RLIMIT_DATA)``: what the process holds when the run
starts (the interpreter and PyTorch) plus ``--cap-mib`` (default 512 MiB). RLIMIT_DATA counts
a process's private writable memory, PyTorch's tensors among it; Linux refuses to allocate
beyond it, and PyTorch raises the refusal as an error. glibc is told to give blocks of 4 MiB
and more back to the system as soon as they are freed (``MALLOC_MMAP_THRESHOLD_``, set
before the processes start): otherwise it keeps freed blocks of up to 32 MiB for reuse, and
the cap would measure that reserve rather than the tensors. Measured on a 2-core CPU
machine: run 1 needs between 630 and 640 MiB above its start, each process of run 2 between
390 and 400 MiB (its process group, threads and pipes included). On one CPU the pipelined
run is no faster (it recomputes, and its processes share the cores): the point is memory.

With two GPUs or more, each process runs on its own GPU and the cap is
``torch.cuda.set_per_process_memory_fraction``: ``--cap-mib`` (default 400 MiB) of the
device's memory for PyTorch's allocator. Run 1 then needs more than 512 MiB for the weights,
their gradients and the optimizer's state alone, each process of run 2 about half. (This path
is not run by the project's tests, which have no GPU.)

    python examples/memory_cap.py
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.nn.functional import cross_entropy

import gpipe
from gpipe.planning import balance_by_params, plan
from gpipe.planning.memory import profile
from gpipe.runtime import materialize

CLASSES = 10


class Block(nn.Module):
    """A residual layer, ``x + W relu(norm(x))``: deep, and still quick to train."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.relu(self.norm(x)))


def model(width: int, depth: int) -> nn.Sequential:
    """``depth`` residual layers and a head, on the meta device: no memory yet."""
    with torch.device("meta"):
        head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, CLASSES))
        return nn.Sequential(*(Block(width) for _ in range(depth)), head)


def batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Mini-batch ``step``: one of four, in turn, of random inputs and the classes a fixed
    random linear teacher gives them. Made afresh each time, so no process keeps them."""
    teacher = torch.randn(args.width, CLASSES, generator=torch.Generator().manual_seed(0))
    seed = torch.Generator().manual_seed(1 + step % 4)
    x = torch.randn(args.batch_size, args.width, generator=seed)
    return x, (x @ teacher).argmax(1)


def cap(args: argparse.Namespace, device: torch.device) -> str:
    """Cap this process's memory at ``--cap-mib``: above what it holds now on CPU, of the
    allocator's on a GPU."""
    limit = args.cap_mib * 2**20
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
        return f"{args.cap_mib} MiB of {device} for PyTorch's allocator"
    with open("/proc/self/status") as status:
        held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (held + limit, held + limit))
    return f"{args.cap_mib} MiB of private memory above the {held / 2**20:.0f} MiB held at start"


def out_of_memory(exc: BaseException) -> str | None:
    """What ran out, in a few words, if ``exc`` says memory did; None otherwise."""
    text = str(exc)
    cpu = re.search(r"can't allocate memory: you tried to allocate \d+ bytes", text)
    if cpu is not None:
        return cpu.group(0)
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return text.strip().splitlines()[0][:120] if text.strip() else type(exc).__name__
    return None


def train(step_fn: Any, optimizer: Any, args: argparse.Namespace, losses: list[float]) -> None:
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = step_fn(*batch(step, args))
        optimizer.step()  # Adam's state is allocated in the first one
        losses.append(loss)


def guarded(run: Any, how: str) -> dict[str, Any]:
    """``run(losses)``'s losses and time, or where memory ran out: at which step, and why."""
    losses: list[float] = []
    start = time.perf_counter()
    try:
        run(losses)
    except Exception as exc:
        reason = out_of_memory(exc)
        if reason is None:
            raise
        return {"cap": how, "out_of_memory": reason, "step": len(losses) + 1}
    return {"cap": how, "losses": losses, "seconds": time.perf_counter() - start}


def adam(params: Any, args: argparse.Namespace) -> torch.optim.Optimizer:
    # One parameter at a time: the multi-tensor version would add a copy of every state.
    return torch.optim.Adam(params, lr=args.lr, foreach=False)


def unpipelined(args: argparse.Namespace, capped: bool) -> dict[str, Any]:
    """The whole model in one process."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    how = cap(args, device) if capped else "none"

    def run(losses: list[float]) -> None:
        layers = enumerate(model(args.width, args.depth))
        whole = nn.Sequential(*(materialize(layer, i, device, args.seed) for i, layer in layers))

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = cross_entropy(whole(x.to(device)), y.to(device))
            loss.backward()
            return loss.item()

        train(step, adam(whole.parameters(), args), args, losses)

    return guarded(run, how)


def pipelined(args: argparse.Namespace) -> dict[str, Any]:
    """One of two processes, each capped alike: a stage of the pipeline and its optimizer."""
    rank = int(os.environ["LOCAL_RANK"])
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    how = cap(args, device)

    def run(losses: list[float]) -> None:
        layers = model(args.width, args.depth)
        pipe = gpipe.Pipeline(
            layers,
            balance_by_params(2, layers),
            chunks=args.chunks,
            checkpoint="always",
            loss_fn=cross_entropy,
            device=device,
            seed=args.seed,
        )
        train(lambda x, y: pipe.step(x, y).item(), adam(pipe.parameters(), args), args, losses)

    return guarded(run, how)


def predicted(args: argparse.Namespace) -> str:
    """The memory planner's peak per process, one process and two, from a meta profile."""
    layers = model(args.width, args.depth)
    x, y = (t.to("meta") for t in batch(0, args))
    rows = args.batch_size // args.chunks
    prof = profile(layers, x[:rows], target=y[:rows], loss_fn=cross_entropy)
    mib = []
    for stages in (1, 2):
        balance = balance_by_params(stages, layers)
        p = plan(
            prof,
            balance,
            batch_size=args.batch_size,
            chunks=args.chunks,
            checkpoint="always",
            optimizer="adam",
        )
        mib.append(" and ".join(f"{r.total_bytes / 2**20:.0f}" for r in p.ranks))
    return f"one process {mib[0]} MiB; two processes {mib[1]} MiB"


def _report(name: str, result: dict[str, Any]) -> str:
    if "out_of_memory" in result:
        return f"{name}: out of memory in step {result['step']} ({result['out_of_memory']})"
    losses = result["losses"]
    passes = [sum(losses[i : i + 4]) / 4 for i in range(0, len(losses) - 3, 4)] or losses
    return (
        f"{name}: trained {len(losses)} steps in {result['seconds']:.0f} s, mean loss of each "
        f"pass over the 4 mini-batches {' '.join(f'{x:.3f}' for x in passes)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8, help="residual layers")
    parser.add_argument(
        "--cap-mib", type=int, help="memory cap per process (default 512 on CPU, 400 on a GPU)"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.device_count() >= 2 else "cpu",
        help="cuda needs two GPUs (default: cuda where there are, else cpu)",
    )
    args = parser.parse_args(argv)
    if args.device == "cpu" and not sys.platform.startswith("linux"):
        parser.error("the cap on CPU is Linux's RLIMIT_DATA: run it on Linux, or on two GPUs")
    if args.cap_mib is None:
        args.cap_mib = 400 if args.device == "cuda" else 512
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))  # before any process starts

    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    print(
        f"model: {args.depth} layers of width {args.width} and a head, {params / 1e6:.1f} M "
        f"parameters; Adam, {args.batch_size} rows per step in {args.chunks} micro-batches"
    )
    print(f"planner (checkpoint always): {predicted(args)}")
    alone = gpipe.launch(unpipelined, 1, (args, True), threads=1)[0]
    print(f"cap: {alone['cap']}, on {args.device}")
    print(_report("without the pipeline, capped", alone))
    name = "pipelined, K = 2, checkpoint always, capped"
    try:
        piped = gpipe.launch(pipelined, 2, (args,), threads=1)
    except gpipe.LaunchError as exc:  # a process that runs out of memory leaves its peer waiting
        print(f"{name}: failed\n{exc}")
        return 1
    print(_report(name, piped[1]))
    torch.set_num_threads(1)
    reference = unpipelined(args, capped=False)
    print(_report("without the pipeline, uncapped", reference))

    if "out_of_memory" not in alone:
        print(f"not shown: one process trains within the cap of {args.cap_mib} MiB")
        return 1
    if any("losses" not in r for r in piped.values()):
        print("not shown: the pipelined run did not fit")
        return 1
    pairs = zip(piped[1]["losses"], reference["losses"], strict=True)
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    print(f"same losses: largest relative difference {worst:.1e} over {args.steps} steps")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
