"""From the processes' raw timings and memory to the figures a reader compares: medians and
spread, throughput, ratios to the ideal and to PyTorch, bubble, memory; and the targets."""

from __future__ import annotations

import statistics
from typing import Any

from gpipe.bench.contenders import STAGES_PER_PROCESS, Contender, K
from gpipe.bench.workloads import Workload
from gpipe.planning import closed_form_bubble
from gpipe.schedules import traits

__all__ = ["figures", "markdown", "summary", "targets"]

MiB = 2**20
LEVEL = 1.03  # a per-cycle ratio within this machine's noise: level, not behind


def summary(samples: list[float]) -> dict[str, float]:
    """Median and spread of repeated measurements."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def _schedule_bubble(c: Contender, chunks: int) -> float | None:
    """The schedule's own bubble in closed form for equal stages (gpipe and 1f1b
    (K-1)/(M+K-1), interleaved (K-1)/(vM+K-1), ...); None ("n/a") where the form depends on
    the forward, backward and weight times (zero-bubble's, the V schedules'), which the
    benchmark does not know, or where the schedule has none."""
    if c.schedule is None:
        return None
    v = traits(c.schedule).stages_per_rank(STAGES_PER_PROCESS)
    forms = {closed_form_bubble(c.schedule, K, chunks, v, *fbw) for fbw in _UNEQUAL_PASSES}
    return forms.pop() if len(forms) == 1 else None


# Two sets of forward, backward and weight times: a form that gives the same under both does
# not depend on them (a None under either is no form).
_UNEQUAL_PASSES = ((1.0, 1.0, 1.0), (1.0, 2.5, 0.5))


def _at(chunks: int, c: Contender, per_rank: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per measured cycle: the step's wall time (its slowest process) and CPU time summed
    over the processes."""
    runs = [r["chunks"][str(chunks)] for r in per_rank]
    wall = [max(ts) for ts in zip(*(r["seconds"][c.name] for r in runs), strict=True)]
    cpu = [sum(ts) for ts in zip(*(r["cpu"][c.name] for r in runs), strict=True)]
    return {"wall": wall, "cpu": cpu}


def figures(
    workload: Workload,
    chosen: list[Contender],
    timing: list[dict[str, Any]],
    memory: dict[str, list[dict[str, Any]]],
    chunk_counts: list[int],
    memory_chunks: int | None,
) -> dict[str, Any]:
    """Everything reported about one workload; ``timing`` and ``memory`` are per process."""
    skipped = timing[0]["skipped"]
    ran = [c for c in chosen if c.name not in skipped]
    by_name = {c.name: c for c in ran}
    out: dict[str, Any] = {
        "workload": workload.name,
        "description": workload.description,
        "config": workload.config,
        "balance": list(workload.balance),
        "interleaved_balance": list(workload.interleaved_balance),
        "skipped": skipped,
        "memory_chunks": memory_chunks,
        "chunks": {},
        "memory": {},
    }
    for chunks in chunk_counts:
        timed = timing[0]["chunks"][str(chunks)]["seconds"]
        cycles = {c.name: _at(chunks, c, timing) for c in ran if c.name in timed}
        med = {n: statistics.median(v["wall"]) for n, v in cycles.items()}
        ideal = med["at-once"] * (chunks + K - 1) / chunks if "at-once" in med else None
        naive = (
            med["accumulation"] * (chunks + K - 1) / (chunks * K) if "accumulation" in med else None
        )
        rows: dict[str, Any] = {}
        for name, cyc in cycles.items():
            c = by_name[name]
            seconds = med[name]
            row: dict[str, Any] = {
                "seconds": summary(cyc["wall"]),
                "samples_per_s": workload.batch / seconds,
                "tokens_per_s": workload.batch * workload.tokens_per_sample / seconds,
                "over_ideal": None if ideal is None else seconds / ideal,
                "over_naive_ideal": None if naive is None else seconds / naive,
                # share of the K processes' time not spent computing (CPU time / wall time)
                "bubble": statistics.median(
                    1 - cpu / (K * wall) for cpu, wall in zip(cyc["cpu"], cyc["wall"], strict=True)
                ),
                "schedule_bubble": _schedule_bubble(c, chunks),
                "counterpart": c.counterpart if c.counterpart in cycles else None,
                "over_counterpart": None,
                "over_counterpart_per_cycle": None,
                # both stages computing at once with no dependency: what a schedule could
                # reach at best, per cycle so that the machine's drifts cancel
                "over_at_once_per_cycle": None,
            }
            if "at-once" in cycles and name != "at-once":
                row["over_at_once_per_cycle"] = summary(
                    [a / b for a, b in zip(cyc["wall"], cycles["at-once"]["wall"], strict=True)]
                )
            if c.counterpart is not None and c.counterpart in cycles:
                other = cycles[c.counterpart]["wall"]
                row["over_counterpart"] = seconds / med[c.counterpart]
                row["over_counterpart_per_cycle"] = summary(
                    [a / b for a, b in zip(cyc["wall"], other, strict=True)]
                )
            rows[name] = row
        out["chunks"][str(chunks)] = {
            "ideal": ideal,
            "naive_ideal": naive,
            "contenders": rows,
            "not_run": timing[0]["chunks"][str(chunks)].get("not_run", {}),
        }
    for name, per_rank in memory.items():
        stages: dict[str, dict[str, int]] = {}
        for r in per_rank:
            stages.update(r["stages"])
        out["memory"][name] = {
            "rss_start": [r["rss_start"] for r in per_rank],
            "rss_peak": [r["rss_peak"] for r in per_rank],
            "activations": [stages[s]["activations"] for s in sorted(stages, key=int)],
            "saved": [stages[s]["saved"] for s in sorted(stages, key=int)],
        }
    return out


def _target(text: str, figure: str, met: bool | None) -> dict[str, Any]:
    return {"target": text, "figure": figure, "met": met}


NOT_MEASURED = "not measured in this run"


def targets(results: dict[str, Any], memory_chunks: int | None) -> list[dict[str, Any]]:
    """The targets, each with the figure it was judged on; ``met`` is None where this run
    did not measure what a target needs (another workload, M or memory pass)."""
    return [
        *_counterpart_targets(results),
        *_overhead_targets(results),
        *_memory_targets(results, memory_chunks),
    ]


def _contenders_at(results: dict[str, Any], workload: str, chunks: int) -> dict[str, Any]:
    found = results.get(workload, {}).get("chunks", {}).get(str(chunks), {})
    return found.get("contenders", {})


def _counterpart_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each gpipe schedule level with its PyTorch counterpart at M >= 4, and zero-bubble
    below it."""
    out = []
    for name, w in results.items():
        for chunks, at in w["chunks"].items():
            if int(chunks) < 4:
                continue
            for cname, row in at["contenders"].items():
                if not cname.endswith("/never") or row["over_counterpart"] is None:
                    continue
                per_cycle = row["over_counterpart_per_cycle"]["median"]
                # level within the machine's noise counts: per-cycle medians, <= 1.03
                out.append(
                    _target(
                        f"{name}, M={chunks}: {cname} / {row['counterpart']} <= 1.03 per cycle",
                        f"{row['over_counterpart']:.3f} (per cycle {per_cycle:.3f})",
                        per_cycle <= LEVEL,
                    )
                )
                if cname == "gpipe/zero-bubble/never":
                    out.append(
                        _target(
                            f"{name}, M={chunks}: zero-bubble below Schedule1F1B (<= 0.97)",
                            f"per cycle {per_cycle:.3f}",
                            per_cycle <= 0.97,
                        )
                    )
    if not out:
        out.append(
            _target(
                "every gpipe schedule / its PyTorch counterpart <= 1.03, M >= 4", NOT_MEASURED, None
            )
        )
    return out


def _overhead_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """gpipe's own cost at M=8: over the ideal on mlp, zero-bubble-v over both stages at
    once on mlp and gpt, per action and against PyTorch on the narrow mlp64."""
    out = []
    text = "mlp, M=8: gpipe/gpipe/never <= 1.10 x ideal"
    row = _contenders_at(results, "mlp", 8).get("gpipe/gpipe/never")
    if row is not None and row["over_ideal"] is not None:
        out.append(_target(text, f"{row['over_ideal']:.3f}", row["over_ideal"] <= 1.10))
    else:
        out.append(_target(text, NOT_MEASURED, None))

    narrow = results.get("mlp64", {}).get("chunks", {}).get("8", {})
    text = "mlp64, M=8: gpipe/gpipe/never fixed cost per action over the ideal <= 150 us"
    row = narrow.get("contenders", {}).get("gpipe/gpipe/never")
    if row is not None and narrow.get("ideal"):
        actions = 4 * 8  # per process: F, B, a send and a receive per micro-batch
        over = (row["seconds"]["median"] - narrow["ideal"]) / actions * 1e6
        out.append(_target(text, f"{over:.0f} us", over <= 150))
    else:
        out.append(_target(text, NOT_MEASURED, None))
    for workload in ("mlp", "gpt"):
        text = f"{workload}, M=8: gpipe/zero-bubble-v/never <= 1.08 x at-once per cycle"
        row = _contenders_at(results, workload, 8).get("gpipe/zero-bubble-v/never")
        if row is not None and row["over_at_once_per_cycle"] is not None:
            per_cycle = row["over_at_once_per_cycle"]["median"]
            out.append(_target(text, f"{per_cycle:.3f}", per_cycle <= 1.08))
        else:
            out.append(_target(text, NOT_MEASURED, None))
    for schedule, theirs in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")):
        text = f"mlp64, M=8: gpipe/{schedule}/never <= 0.90 x pytorch/{theirs} per cycle"
        row = _contenders_at(results, "mlp64", 8).get(f"gpipe/{schedule}/never")
        if row is not None and row["over_counterpart_per_cycle"] is not None:
            per_cycle = row["over_counterpart_per_cycle"]["median"]
            out.append(_target(text, f"{per_cycle:.3f}", per_cycle <= 0.90))
        else:
            out.append(_target(text, NOT_MEASURED, None))
    return out


def _memory_targets(results: dict[str, Any], memory_chunks: int | None) -> list[dict[str, Any]]:
    """What re-materialization saves and costs on gpt at M=8, and gpipe's peak RSS against
    PyTorch's."""
    out = []
    memory = results.get("gpt", {}).get("memory", {}) if memory_chunks == 8 else {}
    never, always = memory.get("gpipe/gpipe/never"), memory.get("gpipe/gpipe/always")
    text = "gpt, M=8: activations per stage, gpipe/gpipe checkpoint always / never <= 0.25"
    if never and always:
        shares = [a / n for a, n in zip(always["activations"], never["activations"], strict=True)]
        figure = ", ".join(f"{s:.3f}" for s in shares)
        out.append(_target(text, figure, max(shares) <= 0.25))
    else:
        out.append(_target(text, NOT_MEASURED, None))

    text = "gpt, M=8: step time, gpipe/gpipe checkpoint always / never <= 1.35"
    times = _contenders_at(results, "gpt", 8)
    if "gpipe/gpipe/never" in times and "gpipe/gpipe/always" in times:
        cost = (
            times["gpipe/gpipe/always"]["seconds"]["median"]
            / times["gpipe/gpipe/never"]["seconds"]["median"]
        )
        out.append(_target(text, f"{cost:.3f}", cost <= 1.35))
    else:
        out.append(_target(text, NOT_MEASURED, None))

    text = "gpt, M=8: peak RSS per process, gpipe/gpipe/always <= pytorch/Schedule1F1B"
    one_f = memory.get("pytorch/Schedule1F1B")
    if always and one_f:
        ours, theirs = max(always["rss_peak"]), max(one_f["rss_peak"])
        figure = f"{ours / MiB:.0f} MiB against {theirs / MiB:.0f} MiB"
        out.append(_target(text, figure, ours <= theirs))
    else:
        out.append(_target(text, NOT_MEASURED, None))
    return out


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _mib(values: list[int]) -> str:
    return ", ".join(f"{v / MiB:.0f}" for v in values)


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: per workload, step time against M, then every figure at the
    memory pass's M; then the targets."""
    lines = [
        "# gpipe bench",
        "",
        f"Command: `{report['command']}`",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()),
        "",
        f"K = {K} processes, {report['settings']['threads']} thread each; "
        f"{report['settings']['warmup']} warm-up and {report['settings']['repeats']} measured "
        "steps per contender, one step each in turn; medians, spread = smallest to largest.",
    ]
    lines += [f"\n**Note**: {note}." for note in report.get("caveats", [])]
    for w in report["workloads"].values():
        chunk_counts = list(w["chunks"])
        names = list(dict.fromkeys(n for at in w["chunks"].values() for n in at["contenders"]))
        lines += ["", f"## {w['workload']}: {w['description']}", ""]
        lines += [f"Stages: {w['balance']} layers (interleaved: {w['interleaved_balance']})."]
        for name, reason in w["skipped"].items():
            lines += ["", f"- {name} did not run: {reason}"]
        lines += ["", "Median seconds per step:", ""]
        lines += ["| contender | " + " | ".join(f"M={m}" for m in chunk_counts) + " |"]
        lines += ["|---" * (len(chunk_counts) + 1) + "|"]
        for name in names:
            rows = [w["chunks"][m]["contenders"].get(name) for m in chunk_counts]
            cells = ["" if r is None else f"{r['seconds']['median']:.3f}" for r in rows]
            lines += [f"| {name} | " + " | ".join(cells) + " |"]
        ideal = [w["chunks"][m]["ideal"] for m in chunk_counts]
        naive = [w["chunks"][m]["naive_ideal"] for m in chunk_counts]
        lines += ["| *ideal* | " + " | ".join(_ratio(v) for v in ideal) + " |"]
        lines += ["| *naive ideal* | " + " | ".join(_ratio(v) for v in naive) + " |"]
        for m in chunk_counts:
            lines += _detail(w, m)
    lines += ["", "## Targets", "", "| target | figure | met |", "|---|---|---|"]
    for t in report["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines += [f"| {t['target']} | {t['figure']} | {met} |"]
    return "\n".join(lines) + "\n"


def _detail(w: dict[str, Any], chunks: str) -> list[str]:
    at = w["chunks"][chunks]
    per_s = "tokens/s" if w["workload"] == "gpt" else "samples/s"
    lines = [
        "",
        f"### {w['workload']}, M = {chunks}",
        "",
        f"ideal {_ratio(at['ideal'])} s (at-once x (M+K-1)/M), naive ideal "
        f"{_ratio(at['naive_ideal'])} s (accumulation x (M+K-1)/(M K)).",
        "",
        f"| contender | s/step | spread | {per_s} | x ideal | x naive ideal | vs | x it "
        "(per cycle) | bubble (schedule) | peak RSS MiB | activations MiB | saved MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    not_run = at.get("not_run", {})
    if not_run:
        told = "; ".join(f"{name} ({why})" for name, why in not_run.items())
        lines[4:4] = [f"Not run at this M: {told}.", ""]
    for name, row in at["contenders"].items():
        s = row["seconds"]
        rate = row["tokens_per_s"] if w["workload"] == "gpt" else row["samples_per_s"]
        vs = row["counterpart"] or ""
        against = ""
        if row["over_counterpart"] is not None:
            per_cycle = row["over_counterpart_per_cycle"]["median"]
            against = f"{row['over_counterpart']:.3f} ({per_cycle:.3f})"
        bubble = f"{row['bubble']:.1%}"
        if row["schedule_bubble"] is not None:
            bubble += f" ({row['schedule_bubble']:.1%})"
        elif name.startswith("gpipe/") and name.count("/") == 2:  # a schedule without a form
            bubble += " (n/a)"
        mem = w["memory"].get(name) if chunks == str(w["memory_chunks"]) else None
        rss = _mib(mem["rss_peak"]) if mem else ""
        act = _mib(mem["activations"]) if mem else ""
        saved = _mib(mem["saved"]) if mem else ""
        lines.append(
            f"| {name} | {s['median']:.3f} | {s['min']:.3f} to {s['max']:.3f} | {rate:,.0f} | "
            f"{_ratio(row['over_ideal'])} | {_ratio(row['over_naive_ideal'])} | {vs} | "
            f"{against} | {bubble} | {rss} | {act} | {saved} |"
        )
    return lines
