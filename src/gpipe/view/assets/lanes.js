// Drawing: lanes of blocks on a shared time axis and a memory chart per lane. Blocks are
// hidden until the clock reaches their start and grow to their end.
(function (root) {
  "use strict";
  const G = root.gpipeView;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const KIND_NAMES = {
    F: "forward",
    B: "backward",
    W: "weight gradients",
    R: "recomputation",
    SEND_F: "send of activations",
    RECV_F: "receive of activations",
    SEND_B: "send of gradients",
    RECV_B: "receive of gradients",
  };
  const GUTTER = 62; // px left of the lanes, for their names
  const NARROW = 700; // px: below this the lanes keep their labels and scroll instead
  const LABEL_ROOM = 26; // px a block needs for a label such as "F12"
  const MAX_WIDTH = 4000;
  const LANE = 30; // px per lane: a bar for compute, a thin track for messages below it
  const BAR = 19;
  const MSG = 5;

  // Simulated times are in the cost model's units, measured ones in seconds (shown in ms).
  function fmtTime(x, unit) {
    if (unit === "s") return `${Number((x * 1e3).toPrecision(4))} ms`;
    return String(Number(x.toPrecision(5)));
  }

  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let power = 0;
    while (n >= 1024 && power < units.length - 1) {
      n /= 1024;
      power += 1;
    }
    return power === 0 ? `${n.toFixed(0)} B` : `${n.toFixed(1)} ${units[power]}`;
  }

  // Blocks of one simulated run: every action, recomputations (R) included.
  function simulated(result, unit) {
    const oneStageEach = result.schedule.nStages === result.spans.length;
    return result.spans.map((spans, rank) => {
      const blocks = [];
      for (const span of spans) {
        const a = span.action;
        const where = oneStageEach ? `stage ${a.stage}` : `rank ${rank}, stage ${a.stage}`;
        blocks.push(block(a.kind, a, span.start, span.end, where, !oneStageEach, unit));
      }
      return { label: oneStageEach ? `stage ${rank}` : `rank ${rank}`, blocks };
    });
  }

  // A block's label is its kind and micro-batch ("F3"), led by its stage where a rank holds
  // several ("2F3", as gpipe prints actions).
  function block(kind, a, start, end, where, withStage, unit) {
    let what = `${KIND_NAMES[kind] || kind}, micro-batch ${a.microbatch}\n${where}`;
    const forward = kind === "SEND_F" || kind === "RECV_B";
    const other = a.peer !== undefined ? a.peer : forward ? a.stage + 1 : a.stage - 1;
    if (kind.startsWith("SEND")) what += `, to stage ${other}`;
    if (kind.startsWith("RECV")) what += `, from stage ${other}`;
    const spanText = kind.startsWith("SEND")
      ? `sent ${fmtTime(start, unit)}, arrives ${fmtTime(end, unit)}`
      : kind.startsWith("RECV")
        ? `waits ${fmtTime(start, unit)} to ${fmtTime(end, unit)}`
        : `start ${fmtTime(start, unit)}, end ${fmtTime(end, unit)}`;
    return {
      kind,
      start,
      end,
      text: kind.length === 1 ? `${withStage ? a.stage : ""}${kind}${a.microbatch}` : "",
      tip: `${kind}${a.microbatch}: ${what}\n${spanText}`,
    };
  }

  // One lane per rank of the schedule (GPipe's one process records all its devices as rank 0).
  function measured(data, unit) {
    const rankOf = data.schedule.stage_to_rank;
    const ranks = rankOf.reduce((a, b) => Math.max(a, b), 0) + 1;
    const oneStageEach = ranks === data.schedule.n_stages;
    const lanes = Array.from({ length: ranks }, (_, r) => ({
      label: oneStageEach ? `stage ${r}` : `rank ${r}`,
      blocks: [],
    }));
    for (const [, stage, kind, mb, start, end] of data.events) {
      const rank = rankOf[stage];
      const where = oneStageEach ? `stage ${stage}` : `rank ${rank}, stage ${stage}`;
      lanes[rank].blocks.push(
        block(kind, { stage, microbatch: mb }, start, end, where, !oneStageEach, unit),
      );
    }
    return lanes;
  }

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG_NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  // One panel of lanes on a shared time axis; blocks hidden until the clock reaches them.
  function panel(container, id, title, lanes, end, width, unit) {
    const top = title ? 18 : 4;
    const height = top + lanes.length * LANE + 22;
    const svg = el("svg", {
      viewBox: `0 0 ${width} ${height}`,
      width,
      height,
      role: "img",
      "aria-label": `${title || "timeline"}: ${lanes.length} lanes`,
    });
    svg.classList.add("panel-svg");
    svg.id = id;
    const x = (t) => GUTTER + (end > 0 ? (t / end) * (width - GUTTER - 8) : 0);
    if (title) {
      const label = el("text", { x: 0, y: 12 }, svg);
      label.classList.add("panel-title");
      label.textContent = title;
    }
    const blocks = [];
    lanes.forEach((lane, i) => {
      const y = top + i * LANE;
      const bg = el("rect", { x: GUTTER, y, width: width - GUTTER - 8, height: BAR }, svg);
      bg.classList.add("lane-bg");
      const name = el("text", { x: 0, y: y + BAR / 2 + 4 }, svg);
      name.classList.add("lane-label");
      name.textContent = lane.label;
      for (const b of lane.blocks) {
        const message = b.kind.length > 1;
        const left = x(b.start);
        const full = Math.max(x(b.end) - left, message ? 1.5 : 1);
        const rect = el(
          "rect",
          { x: left, y: message ? y + BAR + 2 : y, width: full, height: message ? MSG : BAR },
          svg,
        );
        rect.classList.add("block", `k-${b.kind}`, "pending");
        rect.dataset.kind = b.kind;
        rect.dataset.index = blocks.length;
        rect.dataset.start = String(b.start);
        rect.dataset.end = String(b.end);
        let label = null;
        if (b.text && full >= 7 * b.text.length + 4) {
          label = el(
            "text",
            { x: left + full / 2, y: y + BAR / 2 + 4, "text-anchor": "middle" },
            svg,
          );
          label.classList.add("label", `on-${b.kind}`, "pending");
          label.textContent = b.text;
        }
        blocks.push({ ...b, rect, label, left, full, x, state: "pending" });
      }
    });
    const axisY = top + lanes.length * LANE + 2;
    const axis = el("g", {}, svg);
    axis.classList.add("axis");
    el("line", { x1: GUTTER, x2: width - 8, y1: axisY, y2: axisY }, axis);
    for (const t of ticks(end, Math.max(2, Math.floor((width - GUTTER) / 90)))) {
      el("line", { x1: x(t), x2: x(t), y1: axisY, y2: axisY + 4 }, axis);
      const label = el("text", { x: x(t), y: axisY + 15, "text-anchor": "middle" }, axis);
      label.textContent = fmtTime(t, unit);
    }
    const cursor = el("line", { x1: GUTTER, x2: GUTTER, y1: top - 2, y2: axisY }, svg);
    cursor.classList.add("cursor");
    container.appendChild(svg);
    const byStart = blocks.slice().sort((a, b) => a.start - b.start);
    return { svg, blocks, byStart, x, cursor, shown: 0 };
  }

  // The lanes fit the panel; on a narrow screen they may grow (and the panel scroll sideways)
  // until the shortest compute block is wide enough for its label.
  function width(room, lanes, end) {
    const fit = Math.max(room, 280);
    if (room >= NARROW || !(end > 0)) return fit;
    let shortest = Infinity;
    for (const lane of lanes) {
      for (const b of lane.blocks) {
        if (b.kind.length === 1 && b.end > b.start) shortest = Math.min(shortest, b.end - b.start);
      }
    }
    if (!Number.isFinite(shortest)) return fit;
    const wanted = GUTTER + 8 + (end / shortest) * LABEL_ROOM;
    return Math.round(Math.min(Math.max(fit, wanted), MAX_WIDTH));
  }

  function ticks(end, count) {
    if (!(end > 0)) return [0];
    const raw = end / count;
    const step = 10 ** Math.floor(Math.log10(raw));
    const nice = [1, 2, 2.5, 5, 10].map((k) => k * step).find((s) => s >= raw) || raw;
    const out = [];
    for (let t = 0; t <= end * (1 + 1e-9); t += nice) out.push(t);
    return out;
  }

  // A block at time t: hidden before its start, growing until its end, then whole.
  function show(b, t) {
    const state = t < b.start ? "pending" : t >= b.end ? "done" : "active";
    if (state === "active") {
      b.rect.setAttribute("width", Math.max(b.x(t) - b.left, 0.5));
    } else if (b.state === "active" || state !== b.state) {
      b.rect.setAttribute("width", b.full);
    }
    if (state !== b.state) {
      b.rect.classList.toggle("pending", state === "pending");
      if (b.label) b.label.classList.toggle("pending", state !== "done");
      b.state = state;
    }
  }

  // A chart per lane of the activation bytes it holds over time, or the note ``empty``.
  function memory(box, result, end, width, empty) {
    box.textContent = "";
    const top = Math.max(...result.peakRankActivationBytes, 0);
    if (!(top > 0)) {
      const p = document.createElement("p");
      p.className = "note";
      p.textContent = empty;
      box.appendChild(p);
      return [];
    }
    const h = 44;
    const rankOf = result.schedule.stageToRank;
    const oneStageEach = rankOf.length === result.memory.length;
    return result.memory.map((points, rank) => {
      const stages = rankOf.flatMap((r, s) => (r === rank ? [s] : []));
      const who = oneStageEach ? `stage ${rank}` : `rank ${rank} (stages ${stages.join(", ")})`;
      const div = document.createElement("div");
      div.className = "mem-rank";
      div.dataset.peak = String(result.peakRankActivationBytes[rank]);
      const caption = document.createElement("p");
      caption.textContent = `${who}: peak ${fmtBytes(result.peakRankActivationBytes[rank])}`;
      div.appendChild(caption);
      const svg = el("svg", { viewBox: `0 0 ${width} ${h}`, height: h, role: "img" });
      svg.setAttribute("aria-label", caption.textContent);
      const x = (t) => (end > 0 ? (t / end) * (width - 2) : 0) + 1;
      const y = (bytes) => h - 2 - (bytes / top) * (h - 6);
      let d = `M ${x(0)} ${y(0)}`;
      for (const [t, bytes] of points) d += ` H ${x(t)} V ${y(bytes)}`;
      d += ` H ${x(end)} V ${y(0)} Z`;
      el("path", { d }, svg).classList.add("mem-line");
      const cursor = el("line", { x1: 1, x2: 1, y1: 0, y2: h }, svg);
      cursor.classList.add("cursor");
      div.appendChild(svg);
      box.appendChild(div);
      return { cursor, x };
    });
  }

  G.lanes = { GUTTER, fmtBytes, fmtTime, measured, memory, panel, show, simulated, width };
})(globalThis);
