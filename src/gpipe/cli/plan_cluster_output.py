"""What ``gpipe plan --cluster`` prints: one prediction as lines or one JSON object, and
``--search``'s table of the fastest layouts, why the others were left, and the
``gpipe train`` command of the fastest."""

from __future__ import annotations

import json
from typing import Any

from gpipe.planning.cluster import Prediction
from gpipe.planning.cluster_layout import Layout
from gpipe.planning.cluster_search import Search
from gpipe.planning.hardware import Cluster
from gpipe.planning.transformer import TransformerShape
from gpipe.schedules import traits

__all__ = ["prediction_json", "print_json", "print_prediction", "print_search", "train_command"]

_CHECKPOINT = {"none": "never", "selective": "never", "full": "always"}
_MEGATRON = {"optimizer": " (Megatron's distributed optimizer)"}


def _model_line(shape: TransformerShape, p: Prediction) -> str:
    layout = p.layout
    params = f"{shape.params() / 1e9:,.1f} B parameters"
    blocks = f"{shape.layers} blocks of {shape.hidden}"
    if shape.is_moe:
        params += f", {shape.active_params() / 1e9:,.1f} B active"
        blocks += (
            f", {shape.moe_blocks} with {shape.experts} experts ({shape.experts_per_token} a token)"
        )
    return (
        f"{shape.name}: {params} ({blocks}, vocabulary {shape.vocab:,}), "
        f"{layout.global_batch:,} sequences of {layout.seq_len:,} tokens a step"
    )


def _cluster_line(cluster: Cluster, stack: str) -> str:
    d = cluster.device
    return (
        f"cluster {cluster}: {cluster.nodes:,} node{'s' * (cluster.nodes != 1)} of "
        f"{d.gpus_per_node}, "
        f"{d.peak_tflops:g} TFLOP/s dense 16-bit peak, {d.memory_gib:g} GiB each; "
        f"software {stack}"
    )


def _chosen(p: Prediction, name: str) -> int:
    return p.layout.virtual_stages if name == "stages per process" else p.layout.micro_batch


def print_prediction(p: Prediction, shape: TransformerShape, choices: dict[str, list[int]]) -> None:
    """A prediction as lines: the model, the cluster, the layout, then the figures."""
    layout = p.layout
    device = layout.cluster.device
    print(_model_line(shape, p))
    print(_cluster_line(layout.cluster, layout.stack or device.stack))
    print(f"layout {layout.describe()}, {layout.precision}")
    for name, tried in choices.items():
        values = ", ".join(map(str, tried))
        which = "the fastest that fits" if p.fits() else "none fits; the fastest"
        print(f"  {name}: {_chosen(p, name)}, {which} of {values}")
    parts = p.memory.gib()
    listed = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if k != "total")
    fits = "fits" if p.fits() else "DOES NOT FIT"
    eq3 = "Megatron-LM's equation 3: recomputation included"
    rows = [
        ("step time", f"{p.step_time_s:,.3f} s"),
        ("teraFLOP/s per GPU", f"{p.tflops_per_gpu:.1f}  ({eq3})"),
        ("MFU", f"{100 * p.mfu:.1f} %  (model FLOPs, without recomputation, over the peak)"),
        ("pipeline bubble", f"{100 * p.bubble:.1f} % of the processes' time idle"),
        ("tensor parallel", f"{p.tp_comm_s:,.3f} s a step waiting on collectives"),
        ("data parallel", f"{p.dp_exposed_s:,.3f} s a step of collectives exposed"),
        ("optimizer step", f"{p.optimizer_s:,.3f} s"),
        ("memory per GPU", f"{parts['total']:.1f} GiB of {device.memory_gib:g} ({fits})"),
        ("", listed),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}")


def _layout_json(layout: Layout) -> dict[str, Any]:
    return {
        "data_parallel": layout.data_parallel,
        "tensor_parallel": layout.tensor_parallel,
        "stages": layout.stages,
        "schedule": layout.schedule,
        "virtual_stages": layout.n_stages // layout.stages,
        "micro_batch": layout.micro_batch,
        "microbatches": layout.microbatches,
        "global_batch": layout.global_batch,
        "seq_len": layout.seq_len,
        "recompute": layout.recompute,
        "shard": layout.shard or "none",
        "precision": layout.precision,
        "stack": layout.stack or layout.cluster.device.stack,
    }


def prediction_json(p: Prediction) -> dict[str, Any]:
    """A prediction as plain JSON values; the issue's four keys first."""
    layout = p.layout
    return {
        "step_time_s": p.step_time_s,
        "tflops_per_gpu": p.tflops_per_gpu,
        "mfu": p.mfu,
        "memory_per_gpu_gib": p.memory_per_gpu_gib,
        "memory_gib": p.memory.gib(),
        "fits": p.fits(),
        "bubble": p.bubble,
        "tp_comm_s": p.tp_comm_s,
        "dp_exposed_s": p.dp_exposed_s,
        "optimizer_s": p.optimizer_s,
        "layout": _layout_json(layout),
        "cluster": str(layout.cluster),
    }


def print_json(p: Prediction, shape: TransformerShape, choices: dict[str, list[int]]) -> None:
    out = prediction_json(p)
    out["model"] = {
        "name": shape.name,
        "parameters": shape.params(),
        "active_parameters": shape.active_params(),
    }
    if shape.is_moe:
        out["model"] |= {"experts": shape.experts, "experts_per_token": shape.experts_per_token}
    out["chosen"] = {name: {"value": _chosen(p, name), "tried": v} for name, v in choices.items()}
    print(json.dumps(out, indent=2))


def train_command(p: Prediction, model: str) -> str:
    """The ``gpipe train`` command that runs layout ``p`` (``model``: its model flags)."""
    layout = p.layout
    parts = [
        f"gpipe train {model} --device cuda --precision {layout.precision}",
        f"--stages {layout.stages} --data-parallel {layout.data_parallel}",
        f"--tensor-parallel {layout.tensor_parallel} --schedule {layout.schedule}",
    ]
    if traits(layout.schedule).several_stages_per_rank and layout.virtual_stages > 1:
        parts.append(f"--virtual-stages {layout.virtual_stages}")
    parts.append(
        f"--batch-size {layout.global_batch} --chunks {layout.microbatches} "
        f"--seq-len {layout.seq_len} --checkpoint {_CHECKPOINT[layout.recompute]}"
    )
    if layout.shard:
        parts.append(f"--shard {layout.shard}")
    return " ".join(parts)


def _row(rank: int, p: Prediction) -> list[str]:
    layout = p.layout
    several = traits(layout.schedule).several_stages_per_rank
    return [
        str(rank),
        str(layout.data_parallel),
        str(layout.tensor_parallel),
        str(layout.stages),
        layout.schedule,
        str(layout.n_stages // layout.stages) if several else "-",
        str(layout.micro_batch),
        str(layout.microbatches),
        layout.recompute,
        layout.shard or "none",
        f"{p.step_time_s:,.2f}",
        f"{p.tflops_per_gpu:.1f}",
        f"{100 * p.mfu:.1f}%",
        f"{p.memory_per_gpu_gib:.1f}",
    ]


def _table(rows: list[list[str]]) -> None:
    header = [
        "#",
        "D",
        "T",
        "K",
        "schedule",
        "v",
        "b",
        "M",
        "recompute",
        "shard",
        "step_s",
        "TFLOP/s/GPU",
        "MFU",
        "GiB/GPU",
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def print_search(
    found: Search, shape: TransformerShape, cluster: Cluster, model: str, as_json: bool
) -> None:
    """``--search``'s answer: the fastest layouts that fit, why the others do not, and the
    command that runs the fastest."""
    memory = cluster.device.memory_gib
    trained = found.trained
    slower = max(found.fitting - len(found.best), 0)
    reasons = dict(found.rejected.most_common())
    if slower:
        reasons["fit, but slower"] = slower
    if as_json:
        least = found.least
        out = {
            "model": shape.name,
            "cluster": str(cluster),
            "searched": found.searched,
            "fitting": found.fitting,
            "seconds": found.seconds,
            "best": [prediction_json(p) for p in found.best],
            "rejected": reasons,
            "least_memory_gib": None if least is None else least.memory.total / 2**30,
            "least_memory_layout": None if least is None else _layout_json(least.layout),
            "trained": None if trained is None else prediction_json(trained),
            "train_command": None if trained is None else train_command(trained, model),
        }
        print(json.dumps(out, indent=2))
        return
    print(
        f"{shape.name} on {cluster}: {found.searched:,} layouts searched in "
        f"{found.seconds:.1f} s, {found.fitting:,} fit in {memory:g} GiB per GPU"
    )
    if found.best:
        _table([_row(i + 1, p) for i, p in enumerate(found.best)])
    print("why the others were left:")
    for reason, count in reasons.items():
        extra = ""
        if reason.startswith("does not fit") and found.least is not None:
            least = found.least
            extra = (
                f" (the least memory, {least.memory.total / 2**30:.1f} GiB: "
                f"{least.layout.describe()})"
            )
        print(f"  {count:>8,}  {reason}{extra}")
    if trained is None:
        if found.best:
            print(
                "gpipe train runs none of the layouts that fit: each shards the replicas' "
                f"states as --shard {found.best[0].layout.shard}, which gpipe does not offer"
            )
        return
    if trained is found.best[0]:
        print(f"run the fastest: {train_command(trained, model)}")
        return
    mode = found.best[0].layout.shard
    print(
        f"the fastest shard the replicas' states as --shard {mode}"
        f"{_MEGATRON.get(str(mode), '')}, which gpipe does not offer; the fastest gpipe trains "
        f"takes {trained.step_time_s:,.3f} s a step and {trained.memory_per_gpu_gib:.1f} GiB "
        f"per GPU ({trained.layout.describe()})"
    )
    print(f"run the fastest gpipe trains: {train_command(trained, model)}")
