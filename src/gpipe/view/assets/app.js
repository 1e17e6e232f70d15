// The page: reads the controls, asks schedule.js and simulate.js for the run, draws one lane per
// rank, plays the blocks in at their simulated start, and fills the read-outs.
(function () {
  "use strict";
  const G = globalThis.gpipeView;
  const DATA = JSON.parse(document.getElementById("gpipe-data").textContent);
  const LIMITS = DATA.limits;
  const MIB = 2 ** 20;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PLAY_SECONDS = 10; // a whole run at 1x
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
  const LEGEND = [
    ["F", "F", "forward"],
    ["B", "B", "backward (input gradients when W is split off)"],
    ["W", "W", "weight gradients"],
    ["R", "R", "recomputation"],
    ["SEND_F", "", "message in flight"],
    ["RECV_F", "", "waiting for a message"],
  ];
  const $ = (id) => document.getElementById(id);
  const view = { panels: [], times: [], end: 0, unit: "" };
  const player = { t: 0, playing: false, speed: 1, last: null };

  // ---- numbers --------------------------------------------------------------------------

  function fmtTime(x) {
    if (view.unit === "s") return `${Number((x * 1e3).toPrecision(4))} ms`;
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

  function pct(x) {
    return `${(100 * x).toFixed(1)}%`;
  }

  // ---- controls -> settings --------------------------------------------------------------

  function wholeNumber(id, label, max) {
    const text = $(id).value.trim();
    const n = Number(text);
    if (text === "" || !Number.isInteger(n) || n < 1 || n > max) {
      throw new Error(`${label} must be a whole number from 1 to ${max}, got ${text || "nothing"}`);
    }
    return n;
  }

  function amount(text, label) {
    const n = Number(text);
    if (text === "" || !Number.isFinite(n) || n < 0) {
      throw new Error(`${label} must be a number of at least 0, got ${text || "nothing"}`);
    }
    return n;
  }

  // One number, or one per rank: "1" or "1, 1.5, 1".
  function perRank(id, label, ranks, scale) {
    const parts = $(id).value.split(",").map((p) => p.trim());
    const values = parts.map((p) => amount(p, label) * scale);
    if (values.length === 1) return values[0];
    if (values.length !== ranks) {
      throw new Error(`${label} takes one number or ${ranks} (one per rank), got ${values.length}`);
    }
    return values;
  }

  function readSettings() {
    const stages = wholeNumber("stages", "K", LIMITS.stages);
    const chunks = wholeNumber("chunks", "M", LIMITS.chunks);
    const schedule = $("schedule").value;
    const interleaved = schedule === "interleaved";
    const v = interleaved ? wholeNumber("virtual_stages", "v", LIMITS.virtual_stages) : 1;
    if (interleaved && chunks % stages) {
      throw new Error(`interleaved needs M a multiple of K: M = ${chunks}, K = ${stages}`);
    }
    const bandwidthText = $("bandwidth").value.trim();
    let bandwidth = Infinity;
    if (bandwidthText !== "") {
      bandwidth = amount(bandwidthText, "link bandwidth") * MIB;
      if (!(bandwidth > 0)) throw new Error("link bandwidth must be above 0 (empty: unlimited)");
    }
    const costs = {
      forward: perRank("forward", "F", stages, 1),
      backward: perRank("backward", "B", stages, 1),
      weight: perRank("weight", "W", stages, 1),
      latency: amount($("latency").value.trim(), "link latency"),
      bandwidth,
      message_bytes: amount($("message_mib").value.trim(), "message MiB") * MIB,
      activation_bytes: perRank("activation_mib", "activations MiB", stages, MIB),
    };
    const actions = stages * v * chunks * (schedule === "zero-bubble" ? 7 : 6);
    if (actions > LIMITS.actions) {
      throw new Error(
        `${actions} actions are more than this page draws (${LIMITS.actions}); lower K, M or v`,
      );
    }
    return {
      stages,
      chunks,
      schedule,
      virtual_stages: v,
      checkpoint: $("checkpoint").value,
      costs,
    };
  }

  function showValue(id, value, scale) {
    const text = (x) => String(x / scale);
    $(id).value = Array.isArray(value) ? value.map(text).join(", ") : text(value);
  }

  function fillControls(s) {
    $("stages").value = s.stages;
    $("chunks").value = s.chunks;
    $("schedule").value = s.schedule;
    $("virtual_stages").value = s.virtual_stages;
    $("checkpoint").value = s.checkpoint;
    const c = G.costsOf(s.costs);
    showValue("forward", c.forward, 1);
    showValue("backward", c.backward, 1);
    showValue("weight", c.weight, 1);
    showValue("latency", c.latency, 1);
    $("bandwidth").value = Number.isFinite(c.bandwidth) ? String(c.bandwidth / MIB) : "";
    showValue("message_mib", c.message_bytes, MIB);
    showValue("activation_mib", c.activation_bytes, MIB);
    for (const id of ["stages", "chunks"]) $(id).max = LIMITS[id];
    $("virtual_stages").max = LIMITS.virtual_stages;
  }

  // In the measured view the cost fields show the step's mean action times, per stage.
  function showMeasuredCosts(costs) {
    const ms = (x) => `${Number((x * 1e3).toPrecision(3))} ms`;
    for (const id of ["forward", "backward", "weight"]) {
      $(id).value = G.perStage(costs, id, costs.forward.length).map(ms).join(", ");
    }
    $("latency").value = "0";
    $("bandwidth").value = "";
    $("message_mib").value = "not measured";
    $("activation_mib").value = "not measured";
  }

  function measuredOn() {
    return Boolean(DATA.measured) && $("show-measured").checked;
  }

  function syncDisabled() {
    const locked = measuredOn();
    for (const el of $("controls").querySelectorAll("input:not(#show-measured), select")) {
      el.disabled = locked;
    }
    if (!locked) $("virtual_stages").disabled = $("schedule").value !== "interleaved";
  }

  // ---- what to draw ------------------------------------------------------------------------

  // Blocks of one simulated run: every action, and a recomputation ahead of its backward.
  function simulatedLanes(result) {
    const oneStageEach = result.schedule.nStages === result.spans.length;
    return result.spans.map((spans, rank) => {
      const blocks = [];
      for (const span of spans) {
        const a = span.action;
        const where = oneStageEach ? `stage ${a.stage}` : `rank ${rank}, stage ${a.stage}`;
        if (span.recomputed) {
          const cut = span.start + span.recompute;
          blocks.push(block("R", a, span.start, cut, where, !oneStageEach));
          blocks.push(block(a.kind, a, cut, span.end, where, !oneStageEach));
        } else {
          blocks.push(block(a.kind, a, span.start, span.end, where, !oneStageEach));
        }
      }
      return { label: oneStageEach ? `stage ${rank}` : `rank ${rank}`, blocks };
    });
  }

  // A block's label is its kind and micro-batch ("F3"), led by its stage where a rank holds
  // several ("2F3", as gpipe prints actions).
  function block(kind, a, start, end, where, withStage) {
    let what = `${KIND_NAMES[kind] || kind}, micro-batch ${a.microbatch}\n${where}`;
    if (kind.startsWith("SEND")) what += `, to stage ${kind === "SEND_F" ? a.stage + 1 : a.stage - 1}`;
    if (kind.startsWith("RECV")) {
      what += `, from stage ${kind === "RECV_F" ? a.stage - 1 : a.stage + 1}`;
    }
    const spanText = kind.startsWith("SEND")
      ? `sent ${fmtTime(start)}, arrives ${fmtTime(end)}`
      : kind.startsWith("RECV")
        ? `waits ${fmtTime(start)} to ${fmtTime(end)}`
        : `start ${fmtTime(start)}, end ${fmtTime(end)}`;
    return {
      kind,
      start,
      end,
      text: kind.length === 1 ? `${withStage ? a.stage : ""}${kind}${a.microbatch}` : "",
      tip: `${kind}${a.microbatch}: ${what}\n${spanText}`,
    };
  }

  // One lane per rank of the schedule (GPipe's one process records all its devices as rank 0).
  function measuredLanes(measured) {
    const rankOf = measured.schedule.stage_to_rank;
    const ranks = rankOf.reduce((a, b) => Math.max(a, b), 0) + 1;
    const oneStageEach = ranks === measured.schedule.n_stages;
    const lanes = Array.from({ length: ranks }, (_, r) => ({
      label: oneStageEach ? `stage ${r}` : `rank ${r}`,
      blocks: [],
    }));
    for (const [, stage, kind, mb, start, end] of measured.events) {
      const rank = rankOf[stage];
      const where = oneStageEach ? `stage ${stage}` : `rank ${rank}, stage ${stage}`;
      lanes[rank].blocks.push(
        block(kind, { stage, microbatch: mb }, start, end, where, !oneStageEach),
      );
    }
    return lanes;
  }

  function compute() {
    if (measuredOn()) {
      const m = DATA.measured;
      const schedule = G.scheduleFromData(m.schedule);
      const result = G.simulate(schedule, m.costs, "never");
      const measured = measuredLanes(m);
      return { settings: null, result, measured, closed: null, costs: m.costs };
    }
    const s = readSettings();
    const [schedule, costs] = G.scenario(
      s.schedule,
      s.stages,
      s.chunks,
      s.costs,
      s.virtual_stages,
    );
    const result = G.simulate(schedule, costs, s.checkpoint);
    const c = s.costs;
    const equal = [c.forward, c.backward, c.weight, c.activation_bytes].every(
      (x) => !Array.isArray(x) || x.every((y) => y === x[0]),
    );
    const first = (x) => (Array.isArray(x) ? x[0] : x);
    const closed = equal
      ? G.closedFormBubble(
          s.schedule,
          s.stages,
          s.chunks,
          s.virtual_stages,
          first(c.forward),
          first(c.backward),
          first(c.weight),
        )
      : null;
    return { settings: s, result, measured: null, closed, costs };
  }

  // ---- drawing ------------------------------------------------------------------------------

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG_NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  const GUTTER = 62;
  const NARROW = 700; // px: below this the lanes keep their labels and scroll instead
  const LABEL_ROOM = 26; // px a block needs for a label such as "F12"
  const MAX_WIDTH = 4000;
  const LANE = 30;
  const BAR = 19;
  const MSG = 5;

  // One panel of lanes on a shared time axis; blocks hidden until the clock reaches them.
  function drawPanel(container, title, lanes, end, width) {
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
    if (title) svg.id = title.startsWith("measured") ? "measured" : "predicted";
    else svg.id = "predicted";
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
          label = el("text", { x: left + full / 2, y: y + BAR / 2 + 4, "text-anchor": "middle" }, svg);
          label.classList.add("label", `on-${b.kind}`, "pending");
          label.textContent = b.text;
        }
        blocks.push({ ...b, rect, label, left, full, state: "pending" });
      }
    });
    const axisY = top + lanes.length * LANE + 2;
    const axis = el("g", {}, svg);
    axis.classList.add("axis");
    el("line", { x1: GUTTER, x2: width - 8, y1: axisY, y2: axisY }, axis);
    for (const t of ticks(end, Math.max(2, Math.floor((width - GUTTER) / 90)))) {
      el("line", { x1: x(t), x2: x(t), y1: axisY, y2: axisY + 4 }, axis);
      const label = el("text", { x: x(t), y: axisY + 15, "text-anchor": "middle" }, axis);
      label.textContent = fmtTime(t);
    }
    const cursor = el("line", { x1: GUTTER, x2: GUTTER, y1: top - 2, y2: axisY }, svg);
    cursor.classList.add("cursor");
    container.appendChild(svg);
    const byStart = blocks.slice().sort((a, b) => a.start - b.start);
    return { svg, blocks, byStart, x, cursor, shown: 0 };
  }

  // The lanes fit the panel; on a narrow screen they may grow (and the panel scroll sideways)
  // until the shortest compute block is wide enough for its label.
  function lanesWidth(room, lanes, end) {
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

  function setBlock(b, t) {
    const state = t < b.start ? "pending" : t >= b.end ? "done" : "active";
    if (state === "active") {
      b.rect.setAttribute("width", Math.max(b.panelX(t) - b.left, 0.5));
    } else if (b.state === "active" || state !== b.state) {
      b.rect.setAttribute("width", b.full);
    }
    if (state !== b.state) {
      b.rect.classList.toggle("pending", state === "pending");
      if (b.label) b.label.classList.toggle("pending", state !== "done");
      b.state = state;
    }
  }

  function drawMemory(result, end, width) {
    const box = $("memory");
    box.textContent = "";
    const top = Math.max(...result.peakRankActivationBytes, 0);
    if (!(top > 0)) {
      const p = document.createElement("p");
      p.className = "note";
      p.textContent = measuredOn()
        ? "A measured trace holds no activation sizes."
        : "Give activations MiB per micro-batch to see memory.";
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

  function summaryRow(dl, label, id, value, text, note) {
    const dt = document.createElement("dt");
    dt.textContent = label;
    const dd = document.createElement("dd");
    dd.id = id;
    dd.dataset.value = value === null ? "" : String(value);
    dd.textContent = text;
    if (note) {
      const small = document.createElement("small");
      small.textContent = ` ${note}`;
      dd.appendChild(small);
    }
    dl.append(dt, dd);
  }

  const CLOSED_FORMS = {
    gpipe: "(K−1)/(M+K−1)",
    "1f1b": "(K−1)/(M+K−1)",
    interleaved: "(K−1)/(vM+K−1)",
    "zero-bubble": "ZB-H1: (K−1)(F+B−W)/(M(F+B+W)+(K−1)(F+B−W)), M ≥ K, W ≤ F, B",
  };

  function measuredBubble(lanes, span) {
    let busy = 0;
    for (const lane of lanes) {
      for (const b of lane.blocks) if (b.kind.length === 1) busy += b.end - b.start;
    }
    return span > 0 ? 1 - busy / (lanes.length * span) : 0;
  }

  function fillReadouts(run, measuredEnd) {
    const r = run.result;
    const dl = $("summary");
    dl.textContent = "";
    if (run.measured) {
      summaryRow(dl, "measured step", "measured-span", measuredEnd, fmtTime(measuredEnd));
      const mb = measuredBubble(run.measured, measuredEnd);
      summaryRow(dl, "measured bubble", "measured-bubble", mb, pct(mb));
      summaryRow(dl, "predicted makespan", "makespan", r.makespan, fmtTime(r.makespan));
      summaryRow(dl, "predicted bubble", "bubble", r.bubble, pct(r.bubble), "same mean costs, free links");
    } else {
      summaryRow(dl, "makespan", "makespan", r.makespan, fmtTime(r.makespan));
      summaryRow(dl, "bubble (simulated)", "bubble", r.bubble, pct(r.bubble), "idle share of all ranks' time");
      const name = run.settings.schedule;
      const closed = run.closed;
      summaryRow(
        dl,
        "bubble (closed form)",
        "closed-form",
        closed,
        closed === null ? "n/a" : pct(closed),
        closed === null
          ? `${name}: ${CLOSED_FORMS[name]} does not hold here`
          : `${name}: ${CLOSED_FORMS[name]}; equal stages, free links, no recomputation`,
      );
      const recomputed = r.spans.flat().filter((s) => s.recomputed).length;
      summaryRow(dl, "recomputations", "recomputed", recomputed, String(recomputed));
    }
    const actions = r.spans.reduce((n, lane) => n + lane.length, 0);
    summaryRow(dl, run.measured ? "predicted actions" : "actions", "actions", actions, String(actions));
    if (run.measured) {
      const events = run.measured.reduce((n, lane) => n + lane.blocks.length, 0);
      summaryRow(dl, "measured actions", "measured-actions", events, String(events));
    }
    $("per-stage").caption.textContent = run.measured ? "Per stage, predicted" : "Per stage";
    const body = $("per-stage").tBodies[0];
    body.textContent = "";
    const known = !run.measured;
    for (let s = 0; s < r.schedule.nStages; s++) {
      const tr = document.createElement("tr");
      tr.dataset.stage = s;
      const cells = [
        [String(s), s],
        [String(r.schedule.stageToRank[s]), r.schedule.stageToRank[s]],
        [String(r.peakLive[s]), r.peakLive[s]],
        [known ? fmtBytes(r.peakActivationBytes[s]) : "not measured", r.peakActivationBytes[s]],
      ];
      ["stage", "rank", "live", "bytes"].forEach((cls, i) => {
        const td = document.createElement("td");
        td.className = cls;
        td.textContent = cells[i][0];
        td.dataset.value = String(cells[i][1]);
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
  }

  // ---- rendering and playing ---------------------------------------------------------------

  let current = null;

  function render(autoplay) {
    const mode = measuredOn();
    if (mode !== view.measuredMode) {
      if (mode) showMeasuredCosts(DATA.measured.costs);
      else fillControls(DATA.settings);
      view.measuredMode = mode;
    }
    syncDisabled();
    $("error").textContent = "";
    view.unit = mode ? "s" : ""; // a measured step is in seconds, a simulated one in units
    let run;
    try {
      run = compute();
    } catch (err) {
      $("error").textContent = err.message;
      document.body.dataset.state = "error";
      return;
    }
    current = run;
    const box = $("lanes");
    box.textContent = "";
    const simulated = simulatedLanes(run.result);
    let end = run.result.makespan;
    let measuredEnd = 0;
    if (run.measured) {
      for (const lane of run.measured) for (const b of lane.blocks) measuredEnd = Math.max(measuredEnd, b.end);
      end = Math.max(end, measuredEnd);
    }
    view.room = box.clientWidth;
    const width = lanesWidth(view.room, simulated, end);
    view.end = end;
    view.panels = [];
    if (run.measured) {
      view.panels.push(drawPanel(box, "measured", run.measured, end, width));
      view.panels.push(drawPanel(box, "predicted from the same costs", simulated, end, width));
    } else {
      view.panels.push(drawPanel(box, "", simulated, end, width));
    }
    for (const panel of view.panels) for (const b of panel.blocks) b.panelX = panel.x;
    const times = new Set([0, end]);
    for (const panel of view.panels) {
      for (const b of panel.blocks) {
        times.add(b.start);
        times.add(b.end);
      }
    }
    view.times = [...times].sort((a, b) => a - b);
    view.memory = drawMemory(run.result, end, Math.max($("memory").clientWidth, 200));
    fillReadouts(run, measuredEnd);
    document.body.dataset.state = "ready";
    document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
    setTime(0, true);
    if (autoplay && !matchMedia("(prefers-reduced-motion: reduce)").matches) play();
    else if (autoplay) setTime(end);
  }

  function setTime(t, full) {
    const back = t < player.t;
    player.t = Math.min(Math.max(t, 0), view.end);
    for (const panel of view.panels) {
      if (back || full) {
        for (const b of panel.blocks) setBlock(b, player.t);
        panel.active = panel.blocks.filter((b) => b.state === "active");
      } else {
        // Forward in time: only blocks that start now or are still growing change.
        const starts = panel.byStart;
        let i = panel.shown || 0;
        const active = panel.active || [];
        while (i < starts.length && starts[i].start <= player.t) active.push(starts[i++]);
        panel.shown = i;
        for (const b of active) setBlock(b, player.t);
        panel.active = active.filter((b) => b.state === "active");
      }
      if (back || full) {
        panel.shown = panel.byStart.findIndex((b) => b.start > player.t);
        if (panel.shown < 0) panel.shown = panel.byStart.length;
      }
      const cx = panel.x(player.t);
      panel.cursor.setAttribute("x1", cx);
      panel.cursor.setAttribute("x2", cx);
    }
    follow();
    for (const chart of view.memory || []) {
      const cx = chart.x(player.t);
      chart.cursor.setAttribute("x1", cx);
      chart.cursor.setAttribute("x2", cx);
    }
    $("clock").textContent = `t = ${fmtTime(player.t)} of ${fmtTime(view.end)}`;
    $("clock").dataset.value = String(player.t);
    $("scrub").value = view.end > 0 ? String(Math.round((player.t / view.end) * 1000)) : "0";
  }

  // Where the lanes scroll sideways, keep the clock's cursor in sight.
  function follow() {
    const box = $("lanes");
    const panel = view.panels[0];
    if (!panel || box.scrollWidth <= box.clientWidth) return;
    const cx = panel.x(player.t);
    if (cx < box.scrollLeft + GUTTER || cx > box.scrollLeft + box.clientWidth - 20) {
      box.scrollLeft = Math.max(0, cx - box.clientWidth / 3);
    }
  }

  function frame(now) {
    if (!player.playing) return;
    if (player.last !== null) {
      const rate = (view.end / PLAY_SECONDS) * player.speed;
      setTime(player.t + ((now - player.last) / 1000) * rate);
    }
    player.last = now;
    if (player.t >= view.end) {
      pause();
      return;
    }
    requestAnimationFrame(frame);
  }

  function play() {
    if (player.t >= view.end) setTime(0);
    player.playing = true;
    player.last = null;
    $("play").textContent = "pause";
    document.body.dataset.playing = "true";
    requestAnimationFrame(frame);
  }

  function pause() {
    player.playing = false;
    $("play").textContent = "play";
    document.body.dataset.playing = "false";
  }

  function step(direction) {
    pause();
    const eps = 1e-12 * Math.max(1, view.end);
    const times = view.times;
    if (direction > 0) {
      const next = times.find((x) => x > player.t + eps);
      setTime(next === undefined ? view.end : next);
    } else {
      let prev = 0;
      for (const x of times) if (x < player.t - eps) prev = x;
      setTime(prev);
    }
  }

  function changeSpeed(direction) {
    const select = $("speed");
    const i = Math.min(Math.max(select.selectedIndex + direction, 0), select.options.length - 1);
    select.selectedIndex = i;
    player.speed = Number(select.value);
  }

  // ---- wiring -------------------------------------------------------------------------------

  function legend() {
    const ul = $("legend");
    for (const [kind, letter, name] of LEGEND) {
      const li = document.createElement("li");
      const sw = document.createElement("span");
      sw.className = `swatch k-${kind}${letter ? "" : " msg"}`;
      sw.textContent = letter;
      li.append(sw, document.createTextNode(name));
      ul.appendChild(li);
    }
  }

  function tooltip() {
    const tip = $("tip");
    const show = (event) => {
      const rect = event.target.closest && event.target.closest(".block");
      if (!rect || rect.classList.contains("pending")) {
        tip.hidden = true;
        return;
      }
      const panel = view.panels.find((p) => p.svg.contains(rect));
      tip.textContent = panel.blocks[Number(rect.dataset.index)].tip;
      tip.hidden = false;
      const pad = 14;
      const w = tip.offsetWidth;
      const h = tip.offsetHeight;
      let left = event.clientX + pad;
      if (left + w > innerWidth - 4) left = Math.max(4, event.clientX - pad - w);
      let top = event.clientY + pad;
      if (top + h > innerHeight - 4) top = Math.max(4, event.clientY - pad - h);
      tip.style.left = `${left}px`;
      tip.style.top = `${top}px`;
    };
    $("lanes").addEventListener("pointermove", show);
    $("lanes").addEventListener("pointerdown", show);
    $("lanes").addEventListener("pointerleave", () => {
      tip.hidden = true;
    });
  }

  function keys(event) {
    const tag = event.target.tagName;
    if (tag === "INPUT" || tag === "SELECT" || tag === "TEXTAREA") {
      if (event.key === "Escape") event.target.blur();
      if (event.target.id !== "scrub") return;
    }
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const actions = {
      " ": () => (player.playing ? pause() : play()),
      k: () => (player.playing ? pause() : play()),
      ArrowRight: () => step(1),
      ArrowLeft: () => step(-1),
      "+": () => changeSpeed(1),
      "=": () => changeSpeed(1),
      "-": () => changeSpeed(-1),
      Home: () => {
        pause();
        setTime(0);
      },
      End: () => {
        pause();
        setTime(view.end);
      },
    };
    const act = actions[event.key];
    if (act) {
      event.preventDefault();
      act();
    }
  }

  function start() {
    legend();
    tooltip();
    fillControls(DATA.settings);
    view.measuredMode = false;
    if (DATA.measured) {
      $("measured-switch").hidden = false;
      $("subtitle").textContent =
        "A measured step, each rank's lane above the simulator's prediction from the same " +
        "step's mean action times: where they part, messages or overheads cost time.";
    }
    // Typing re-plays at each keystroke; a select or box, once chosen (browsers differ on
    // whether choosing one fires "input" too, but all fire "change").
    const chosen = (target) => target.tagName === "SELECT" || target.type === "checkbox";
    $("controls").addEventListener("input", (event) => chosen(event.target) || render(true));
    $("controls").addEventListener("change", (event) => chosen(event.target) && render(true));
    $("controls").addEventListener("submit", (event) => event.preventDefault());
    $("play").addEventListener("click", () => (player.playing ? pause() : play()));
    $("step-next").addEventListener("click", () => step(1));
    $("step-back").addEventListener("click", () => step(-1));
    $("speed").addEventListener("change", () => {
      player.speed = Number($("speed").value);
    });
    $("scrub").addEventListener("input", () => {
      pause();
      setTime((Number($("scrub").value) / 1000) * view.end);
    });
    document.addEventListener("keydown", keys);
    let resizing = null;
    addEventListener("resize", () => {
      clearTimeout(resizing);
      resizing = setTimeout(() => {
        if ($("lanes").clientWidth === view.room) return; // phones resize as their bars slide
        const t = player.t;
        const playing = player.playing;
        render(false);
        setTime(t, true);
        if (playing) play();
      }, 150);
    });
    render(true);
  }

  start();
})();
