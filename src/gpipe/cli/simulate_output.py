"""What ``gpipe simulate`` shows of its results: the schedules side by side in a table, and
a Gantt chart of each schedule's ranks (``--plot``, with matplotlib)."""

from __future__ import annotations

from typing import Any

from gpipe.cli.common import UsageError
from gpipe.planning.simulate import Costs, SimResult

__all__ = ["figure_class", "plot", "table"]

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}

# The column of the gradients' reduction past the program, by --shard
_REDUCTION = {
    None: "all-reduce exposed",
    "full": "reduce-scatter exposed",
    "optimizer": "reduce-scatter+gather exposed",
    "gradients": "reduce-scatter+gather exposed",
}


def _maybe(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def table(
    rows: list[dict[str, Any]],
    n_stages: int,
    n_microbatches: int,
    costs: Costs,
    replicas: bool = False,
    shard: str | None = None,
) -> str:
    """One row per schedule (a skipped one: its name and why), with the reduction's exposed
    time where there are ``replicas`` and the peak memory where the costs give activations."""
    memory = any(costs.per_stage("activation_bytes", n_stages))
    header = ["schedule", "makespan", "bubble", "formula", "held", "peak live per stage"]
    if memory:
        header.insert(5, "peak memory")
    if replicas:
        header.insert(2, _REDUCTION[shard])
    if shard == "full":
        header.insert(2, "gather exposed")
    lines: list[list[str]] = []
    for row in rows:
        if "note" in row:
            lines.append([row["schedule"], row["note"]])
            continue
        cells = [
            row["schedule"],
            f"{row['makespan']:.6g}",
            f"{row['bubble']:.1%}",
            _maybe(row.get("closed_form_bubble"), "{:.1%}"),
            _maybe(row.get("closed_form_peak"), "{:g}"),
            " ".join(f"{n:g}" for n in row["peak_live_per_stage"]),
        ]
        if memory:
            cells.insert(5, _bytes(row["peak_activation_bytes"]))
        if replicas:
            cells.insert(2, f"{row['allreduce_exposed']:.6g}")
        if shard == "full":
            cells.insert(2, f"{row['gather_exposed']:.6g}")
        lines.append(cells)
    full = [header] + [cells for cells in lines if len(cells) == len(header)]
    widths = [max(len(cells[i]) for cells in full) for i in range(len(header))]
    out = []
    for cells in [header, *lines]:
        if len(cells) < len(header):  # a skipped schedule: its name and why
            out.append(f"{cells[0].ljust(widths[0])}  {cells[1]}")
            continue
        first, *middle, last = cells
        out.append(
            "  ".join(
                [first.ljust(widths[0])]
                + [c.rjust(w) for c, w in zip(middle, widths[1:-1], strict=True)]
                + [last]
            )
        )
    out.append(
        "formula: the schedule's bubble in closed form; held: micro-batches the busiest "
        "process holds at once, by formula (- where none holds)"
    )
    return "\n".join(out)


def _bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n /= 1024
        power += 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def figure_class() -> Any:
    """matplotlib's ``Figure``, or a usage error that says how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(
            "gpipe simulate --plot needs matplotlib: pip install 'gpipe-parallel[plot]'"
        ) from None
    return Figure


def plot(results: list[SimResult], path: str) -> None:
    """A Gantt chart per schedule: one row per rank, F/B/W bars labelled with micro-batches."""
    from matplotlib.patches import Patch

    figure = figure_class()(
        figsize=(12, sum(0.8 + 0.3 * r.schedule.n_ranks for r in results) + 0.5),
        layout="constrained",
    )
    axes = figure.subplots(len(results), 1, squeeze=False, sharex=True)[:, 0]
    longest = max((r.makespan for r in results), default=0.0)
    for ax, result in zip(axes, results, strict=True):
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        label = len(result.events) <= 4000
        for rank, action, start, end in result.events:
            bars.setdefault((rank, action.kind.value), []).append((start, end - start))
            if label and end - start >= 0.015 * longest:
                ax.text(
                    (start + end) / 2,
                    rank,
                    str(action.microbatch),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        for (rank, kind), spans in bars.items():
            ax.broken_barh(
                spans,
                (rank - 0.4, 0.8),
                facecolors=_COLOURS[kind],
                edgecolor="white",
                linewidth=0.5,
            )
        n_ranks = result.schedule.n_ranks
        ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)], fontsize=8)
        ax.set_ylim(n_ranks - 0.5, -0.5)
        ax.set_title(
            f"{result.schedule.name}: makespan {result.makespan:.6g}, bubble {result.bubble:.1%}",
            fontsize=10,
        )
    axes[-1].set_xlabel("time")
    kinds = ["F"]
    kinds += ["B"] if any(r.schedule.backward for r in results) else []
    kinds += ["W"] if any(r.schedule.split_backward for r in results) else []
    axes[0].legend(
        handles=[Patch(color=_COLOURS[k], label=k) for k in kinds],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=len(kinds),
        frameon=False,
        fontsize=8,
    )
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise UsageError(f"--plot {path}: {exc}") from None
