// The page: reads the controls, asks schedule.js and simulate.js for the run, draws it with
// lanes.js, plays the blocks in at their simulated start, and fills the read-outs.
(function () {
  "use strict";
  const G = globalThis.gpipeView;
  const DATA = JSON.parse(document.getElementById("gpipe-data").textContent);
  const LIMITS = DATA.limits;
  const PLAY_SECONDS = 10; // a whole run at 1x
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

  function pct(x) {
    return `${(100 * x).toFixed(1)}%`;
  }

  function compute() {
    if (measuredOn()) {
      const m = DATA.measured;
      const schedule = G.scheduleFromData(m.schedule);
      const result = G.simulate(schedule, m.costs, "never");
      const measured = G.lanes.measured(m, "s");
      return { settings: null, result, measured, closed: null, peak: null };
    }
    const s = G.controls.read(LIMITS, DATA.fixed);
    if (s.schedule === "file") {
      const schedule = G.scheduleFromData(DATA.fixed);
      const result = G.simulate(schedule, G.splitCosts(schedule, s.costs), s.checkpoint);
      return { settings: s, result, measured: null, closed: null, peak: null };
    }
    const [schedule, costs] = G.scenario(s.schedule, s.stages, s.chunks, s.costs, s.virtual_stages);
    const result = G.simulate(schedule, costs, s.checkpoint);
    const c = s.costs;
    const equal =
      !G.unevenMicrobatches(c) &&
      [c.forward, c.backward, c.weight].every(
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
    const v = G.stagesPerRank(s.schedule, s.virtual_stages);
    const peak = G.closedFormPeak(s.schedule, s.stages, s.chunks, v);
    return { settings: s, result, measured: null, closed, peak };
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
    "looped-bfs": "(K−1)/(vM+K−1), M ≥ K",
    "interleaved-zero-bubble": "(K−1)(F+B−W)/v / (M(F+B+W)+(K−1)(F+B−W)/v), W ≤ F, B",
    "zero-bubble-v": "I/(M(F+B+W)+I), I = (K−1)·max(B/2, B−W), M ≥ 2K−1, F, W ≤ B",
    "dualpipe-v": "I/(M(F+B+W)+I), I = (K−1)·max(F, F+B−W)/2, B ≤ F ≤ B+W",
    "v-half": "I/(M(F+B+W)+I), I = (2+⌈M/2⌉)·F/2, K ≤ 2, F = B = W (0 for K = 1)",
    "v-min": "I/(M(F+B+W)+I), I = (2M+1)·F/2, K ≤ 2, F = B = W (0 for K = 1)",
  };

  // closed_form_peak's formulas: the busiest rank's micro-batches held at once.
  const PEAK_FORMS = {
    gpipe: "M",
    "1f1b": "min(M, K)",
    "zero-bubble": "min(M, K)",
    interleaved: "min(M, K+(K−1)/v)",
    "interleaved-zero-bubble": "min(M, K+(K−1)/v)",
    "looped-bfs": "M",
    "zero-bubble-v": "min(M, K), as 1F1B",
    "dualpipe-v": "K+1/2",
    "v-half": "min(K+1, 2M)/2, half of 1F1B's",
    "v-min": "min(max(2, ⌈(2K+2)/3⌉), 2M)/2, a third of 1F1B's",
  };

  function measuredOn() {
    return Boolean(DATA.measured) && $("show-measured").checked;
  }

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
      summaryRow(
        dl,
        "measured step",
        "measured-span",
        measuredEnd,
        G.lanes.fmtTime(measuredEnd, "s"),
      );
      const mb = measuredBubble(run.measured, measuredEnd);
      summaryRow(dl, "measured bubble", "measured-bubble", mb, pct(mb));
      summaryRow(
        dl,
        "predicted makespan",
        "makespan",
        r.makespan,
        G.lanes.fmtTime(r.makespan, view.unit),
      );
      summaryRow(
        dl,
        "predicted bubble",
        "bubble",
        r.bubble,
        pct(r.bubble),
        "same mean costs, free links",
      );
    } else {
      summaryRow(dl, "makespan", "makespan", r.makespan, G.lanes.fmtTime(r.makespan, view.unit));
      summaryRow(
        dl,
        "bubble (simulated)",
        "bubble",
        r.bubble,
        pct(r.bubble),
        "idle share of all ranks' time",
      );
      const name = run.settings.schedule;
      const closed = run.closed;
      summaryRow(
        dl,
        "bubble (closed form)",
        "closed-form",
        closed,
        closed === null ? "n/a" : pct(closed),
        !(name in CLOSED_FORMS)
          ? "a schedule read from a file has no formula"
          : closed === null
            ? `${name}: ${CLOSED_FORMS[name]} does not hold here`
            : `${name}: ${CLOSED_FORMS[name]}; equal stages and micro-batches, free links, ` +
              "no recomputation",
      );
      const peak = run.peak === null ? null : Math.max(...run.peak);
      summaryRow(
        dl,
        "peak memory (closed form)",
        "closed-form-peak",
        peak,
        peak === null ? "n/a" : `${+peak.toFixed(3)} micro-batches`,
        !(name in PEAK_FORMS)
          ? "a schedule read from a file has no formula"
          : peak === null
            ? `${name}: no formula for these sizes`
            : `busiest rank, in micro-batches of its activations: ${PEAK_FORMS[name]}; ` +
              "no recomputation",
      );
      const recomputed = r.spans.flat().filter((s) => s.action.kind === "R").length;
      summaryRow(dl, "recomputations", "recomputed", recomputed, String(recomputed));
    }
    const actions = r.spans.reduce((n, lane) => n + lane.length, 0);
    summaryRow(
      dl,
      run.measured ? "predicted actions" : "actions",
      "actions",
      actions,
      String(actions),
    );
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
        [
          known ? G.lanes.fmtBytes(r.peakActivationBytes[s]) : "not measured",
          r.peakActivationBytes[s],
        ],
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

  function render(autoplay) {
    const mode = measuredOn();
    if (mode !== view.measuredMode) {
      if (mode) G.controls.showMeasured(DATA.measured.costs);
      else G.controls.fill(DATA.settings, LIMITS);
      view.measuredMode = mode;
    }
    G.controls.lock(mode);
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
    const box = $("lanes");
    box.textContent = "";
    const simulated = G.lanes.simulated(run.result, view.unit);
    let end = run.result.makespan;
    let measuredEnd = 0;
    if (run.measured) {
      for (const lane of run.measured)
        for (const b of lane.blocks) measuredEnd = Math.max(measuredEnd, b.end);
      end = Math.max(end, measuredEnd);
    }
    view.room = box.clientWidth;
    const width = G.lanes.width(view.room, simulated, end);
    view.end = end;
    view.panels = [];
    if (run.measured) {
      const predicted = "predicted from the same costs";
      view.panels.push(G.lanes.panel(box, "measured", "measured", run.measured, end, width, "s"));
      view.panels.push(G.lanes.panel(box, "predicted", predicted, simulated, end, width, "s"));
    } else {
      view.panels.push(G.lanes.panel(box, "predicted", "", simulated, end, width, ""));
    }
    const times = new Set([0, end]);
    for (const panel of view.panels) {
      for (const b of panel.blocks) {
        times.add(b.start);
        times.add(b.end);
      }
    }
    view.times = [...times].sort((a, b) => a - b);
    const empty = mode
      ? "A measured trace holds no activation sizes."
      : "Give activations MiB per micro-batch to see memory.";
    const chartWidth = Math.max($("memory").clientWidth, 200);
    view.memory = G.lanes.memory($("memory"), run.result, end, chartWidth, empty);
    fillReadouts(run, measuredEnd);
    document.body.dataset.state = "ready";
    setTime(0, true);
    if (autoplay && !matchMedia("(prefers-reduced-motion: reduce)").matches) play();
    else if (autoplay) setTime(end);
  }

  function setTime(t, full) {
    const back = t < player.t;
    player.t = Math.min(Math.max(t, 0), view.end);
    for (const panel of view.panels) {
      if (back || full) {
        for (const b of panel.blocks) G.lanes.show(b, player.t);
        panel.active = panel.blocks.filter((b) => b.state === "active");
      } else {
        // Forward in time: only blocks that start now or are still growing change.
        const starts = panel.byStart;
        let i = panel.shown || 0;
        const active = panel.active || [];
        while (i < starts.length && starts[i].start <= player.t) active.push(starts[i++]);
        panel.shown = i;
        for (const b of active) G.lanes.show(b, player.t);
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
    $("clock").textContent =
      `t = ${G.lanes.fmtTime(player.t, view.unit)} of ${G.lanes.fmtTime(view.end, view.unit)}`;
    $("clock").dataset.value = String(player.t);
    $("scrub").value = view.end > 0 ? String(Math.round((player.t / view.end) * 1000)) : "0";
  }

  // Where the lanes scroll sideways, keep the clock's cursor in sight.
  function follow() {
    const box = $("lanes");
    const panel = view.panels[0];
    if (!panel || box.scrollWidth <= box.clientWidth) return;
    const cx = panel.x(player.t);
    if (cx < box.scrollLeft + G.lanes.GUTTER || cx > box.scrollLeft + box.clientWidth - 20) {
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
    if (DATA.fixed) G.controls.offerFile(DATA.fixed);
    G.controls.fill(DATA.settings, LIMITS);
    if (DATA.fixed) G.controls.chooseFile();
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
