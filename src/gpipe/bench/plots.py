"""The report's pictures: step time against the number of micro-batches, and activation
memory per stage for each schedule and re-materialization mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpipe.runtime.recompute import CHECKPOINT_MODES

__all__ = ["plot_memory", "plot_step_times"]

MiB = 2**20


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_SCHEDULE_COLOURS = {"gpipe": "C0", "1f1b": "C1", "zero-bubble": "C2", "interleaved": "C3"}
_COUNTERPART = {
    "ScheduleGPipe": "gpipe",
    "Schedule1F1B": "1f1b",
    "ScheduleInterleaved1F1B": "interleaved",
}
_MODE_STYLES = {"never": "-", "except_last": "-.", "always": ":"}


def _style(name: str) -> dict[str, Any]:
    """gpipe's schedules in one colour each, PyTorch's counterpart dashed in the same colour;
    baselines and the one-process libraries in greys and purples."""
    parts = name.split("/")
    if parts[0] == "gpipe" and len(parts) == 3:
        colour = _SCHEDULE_COLOURS.get(parts[1], "C5")  # others: the default
        return {"color": colour, "linestyle": _MODE_STYLES[parts[2]]}
    if parts[0] == "pytorch":
        return {"color": _SCHEDULE_COLOURS[_COUNTERPART.get(parts[1], "gpipe")], "linestyle": "--"}
    others = {
        "full-batch": ("0.55", ":"),
        "accumulation": ("0.35", ":"),
        "at-once": ("0.15", ":"),
        "gpipe/GPipe-1-process": ("C4", "-"),
        "torchgpipe": ("C4", "--"),
    }
    color, linestyle = others.get(name, ("C5", "-"))
    return {"color": color, "linestyle": linestyle}


def plot_step_times(w: dict[str, Any], path: Path) -> Path:
    """Two panels: without re-materialization (gpipe against PyTorch, the baselines and the
    ideal), and gpipe's schedules under each re-materialization mode."""
    plt = _pyplot()
    chunk_counts = [int(m) for m in w["chunks"]]
    names = list(dict.fromkeys(n for at in w["chunks"].values() for n in at["contenders"]))
    panels = {
        "no re-materialization; baselines; one-process libraries": [
            n for n in names if not n.startswith("gpipe/") or n.endswith(("/never", "process"))
        ],
        "gpipe: checkpoint never (solid), except_last (dash-dot), always (dotted)": [
            n for n in names if n.startswith("gpipe/") and n.count("/") == 2
        ],
    }
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
    for ax, (title, chosen) in zip(axes, panels.items(), strict=True):
        for name in chosen:
            ran = [m for m in chunk_counts if name in w["chunks"][str(m)]["contenders"]]
            seconds = [w["chunks"][str(m)]["contenders"][name]["seconds"] for m in ran]
            ax.errorbar(
                ran,
                [s["median"] for s in seconds],
                yerr=[
                    [s["median"] - s["min"] for s in seconds],
                    [s["max"] - s["median"] for s in seconds],
                ],
                marker="o",
                markersize=3,
                capsize=2,
                label=name,
                **_style(name),
            )
        ideal = [w["chunks"][str(m)]["ideal"] for m in chunk_counts]
        if all(v is not None for v in ideal):
            ax.plot(chunk_counts, ideal, color="black", linewidth=2.5, label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_xticks(chunk_counts, [str(m) for m in chunk_counts])
        ax.set_xlabel("micro-batches M")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel("seconds per step (median; bars: smallest to largest)")
    fig.suptitle(f"{w['workload']}: {w['description']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(w: dict[str, Any], path: Path) -> Path:
    """Grouped bars per stage: for each gpipe schedule, one bar per re-materialization mode;
    PyTorch's schedules and the baselines as reference lines."""
    plt = _pyplot()
    memory = w["memory"]
    schedules = list(
        dict.fromkeys(
            n.split("/")[1] for n in memory if n.count("/") == 2 and n.startswith("gpipe/")
        )
    )
    n_stages = max((len(m["activations"]) for m in memory.values()), default=0)
    fig, axes = plt.subplots(1, n_stages, figsize=(6 * n_stages, 5), squeeze=False)
    width = 0.8 / len(CHECKPOINT_MODES)
    references = [
        n for n in memory if n.startswith("pytorch/") or n in ("accumulation", "torchgpipe")
    ]
    for stage, ax in enumerate(axes[0]):
        for i, mode in enumerate(CHECKPOINT_MODES):
            xs, heights = [], []
            for j, schedule in enumerate(schedules):
                m = memory.get(f"gpipe/{schedule}/{mode}")
                if m is not None and stage < len(m["activations"]):
                    xs.append(j + (i - 1) * width)
                    heights.append(m["activations"][stage] / MiB)
            ax.bar(xs, heights, width, label=f"gpipe, checkpoint {mode}")
        for k, name in enumerate(references):
            values = memory[name]["activations"]
            if stage < len(values):
                ax.axhline(
                    values[stage] / MiB, linestyle="--", color=f"C{k + 3}", linewidth=1, label=name
                )
        ax.set_xticks(range(len(schedules)), schedules)
        ax.set_ylabel("peak activation MiB (saved for backward + layer inputs/outputs)")
        ax.set_title(
            f"{w['workload']}, M = {w['memory_chunks']}: stage {stage} "
            "(for interleaved: process, both of its stages)",
            fontsize=9,
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
