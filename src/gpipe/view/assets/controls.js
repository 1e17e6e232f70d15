// The controls: the settings read from them (an error names the bad value) and the values
// written into them, the measured step's own costs included.
(function (root) {
  "use strict";
  const G = root.gpipeView;
  const MIB = 2 ** 20;
  const $ = (id) => document.getElementById(id);

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
    const parts = $(id)
      .value.split(",")
      .map((p) => p.trim());
    const values = parts.map((p) => amount(p, label) * scale);
    if (values.length === 1) return values[0];
    if (values.length !== ranks) {
      throw new Error(`${label} takes one number or ${ranks} (one per rank), got ${values.length}`);
    }
    return values;
  }

  // The schedule of a file (gpipe view --schedule-csv): its K and M are the file's.
  function readShape(limits, fixed) {
    const schedule = $("schedule").value;
    if (schedule === "file") {
      const stages = fixed.programs.length;
      return { stages, chunks: fixed.n_microbatches, schedule, v: fixed.n_stages / stages };
    }
    const stages = wholeNumber("stages", "K", limits.stages);
    const chunks = wholeNumber("chunks", "M", limits.chunks);
    const traits = G.TRAITS[schedule];
    const looped = traits.placement === "looped";
    const v = looped ? wholeNumber("virtual_stages", "v", limits.virtual_stages) : 1;
    if (traits.perRound && chunks % stages) {
      throw new Error(`${schedule} needs M a multiple of K: M = ${chunks}, K = ${stages}`);
    }
    if (traits.perStage && chunks < 2 * stages) {
      throw new Error(`${schedule} needs M at least 2K: M = ${chunks}, K = ${stages}`);
    }
    const fewest = G.fewestMicrobatches(schedule, stages, v);
    if (chunks < fewest) {
      throw new Error(`${schedule} needs M at least ${fewest} for K = ${stages}: M = ${chunks}`);
    }
    return { stages, chunks, schedule, v };
  }

  // The cost factor of each of the M micro-batches, or none: "" or "1, 2.5, 0.5".
  function microbatchScale(chunks) {
    const text = $("microbatch_scale").value.trim();
    if (text === "") return [];
    const label = "cost factor per micro-batch";
    const values = text.split(",").map((p) => amount(p.trim(), label));
    if (values.length !== chunks) {
      throw new Error(`${label} takes M = ${chunks} numbers, one per micro-batch, got ${values.length}`);
    }
    if (values.some((x) => !(x > 0))) throw new Error(`${label} must be above 0`);
    return values;
  }

  function read(limits, fixed) {
    const { stages, chunks, schedule, v } = readShape(limits, fixed);
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
      microbatch_scale: microbatchScale(chunks),
    };
    const actions = stages * v * chunks * (schedule === "zero-bubble" ? 7 : 6);
    if (actions > limits.actions) {
      throw new Error(
        `${actions} actions are more than this page draws (${limits.actions}); lower K, M or v`,
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

  function fill(s, limits) {
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
    $("microbatch_scale").value = (c.microbatch_scale || []).map(String).join(", ");
    for (const id of ["stages", "chunks"]) $(id).max = limits[id];
    $("virtual_stages").max = limits.virtual_stages;
  }

  // In the measured view the cost fields show the step's mean action times, per stage.
  function showMeasured(costs) {
    const ms = (x) => `${Number((x * 1e3).toPrecision(3))} ms`;
    for (const id of ["forward", "backward", "weight"]) {
      $(id).value = G.perStage(costs, id, costs.forward.length).map(ms).join(", ");
    }
    $("latency").value = "0";
    $("bandwidth").value = "";
    $("message_mib").value = "not measured";
    $("activation_mib").value = "not measured";
    $("microbatch_scale").value = "";
  }

  // Locked while the measured run is shown; v only counts for the looped schedules (a V
  // always holds two stages per rank).
  function lock(locked) {
    for (const el of $("controls").querySelectorAll("input:not(#show-measured), select")) {
      el.disabled = locked;
    }
    if (!locked) {
      const schedule = $("schedule").value;
      const file = schedule === "file";
      $("virtual_stages").disabled = file || G.TRAITS[schedule].placement !== "looped";
      $("stages").disabled = file;
      $("chunks").disabled = file;
    }
  }

  // A schedule read from a file becomes one more choice of the schedule control.
  function offerFile(fixed) {
    const option = document.createElement("option");
    option.value = "file";
    option.textContent = `file: ${fixed.name}`;
    $("schedule").append(option);
  }

  function chooseFile() {
    $("schedule").value = "file";
    lock(false);
  }

  G.controls = { chooseFile, fill, lock, offerFile, read, showMeasured };
})(globalThis);
