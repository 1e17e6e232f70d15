// gpipe's simulator (gpipe/simulate.py) in JavaScript: the same cost model, the same walk
// through the ranks' programs, the same times, bubble and memory; tests/view/test_view_parity.py
// holds it to the Python one. It also keeps what the page draws: the span of every action,
// messages included, and each rank's activation bytes over time.
(function (root) {
  "use strict";
  const api = root.gpipeView || (root.gpipeView = {});

  const PER_STAGE = ["forward", "backward", "weight", "activation_bytes"];
  const CHECKPOINT_MODES = ["always", "except_last", "never"];
  const DEFAULTS = {
    weight: 0,
    latency: 0,
    bandwidth: Infinity,
    message_bytes: 0,
    activation_bytes: 0,
  };

  // Costs as gpipe.planning.simulate.Costs holds them; JSON has no infinity, so a null
  // bandwidth is one.
  function costsOf(given) {
    const costs = { ...DEFAULTS, ...given };
    if (costs.bandwidth === null) costs.bandwidth = Infinity;
    return costs;
  }

  function perStage(costs, name, nStages) {
    const value = costs[name];
    if (Array.isArray(value)) {
      if (value.length !== nStages) {
        throw new Error(
          `Costs.${name} has ${value.length} values, but the schedule has ${nStages} stages`,
        );
      }
      return value.slice();
    }
    return new Array(nStages).fill(value);
  }

  // Costs.microbatch_scales: one factor per micro-batch that multiplies its F, B, W and R
  // (packed micro-batches of different tokens), or null when there are none.
  function microbatchScales(costs, nMicrobatches) {
    const scale = costs.microbatch_scale;
    if (!scale || !scale.length) return null;
    if (scale.length !== nMicrobatches) {
      throw new Error(
        `Costs.microbatch_scale has ${scale.length} factors, but the schedule has ` +
          `${nMicrobatches} micro-batches`,
      );
    }
    return scale.slice();
  }

  // Whether the micro-batches cost differently: then no closed form holds.
  function unevenMicrobatches(costs) {
    const scale = costs.microbatch_scale || [];
    return scale.some((x) => x !== scale[0]);
  }

  function checkCheckpoint(mode) {
    if (!CHECKPOINT_MODES.includes(mode)) {
      throw new Error(
        `checkpoint is not one of 'always', 'except_last', or 'never', got ${JSON.stringify(mode)}`,
      );
    }
    return mode;
  }

  // gpipe.runtime.recompute.should_checkpoint: except_last spares the last micro-batch.
  function shouldCheckpoint(mode, microbatch, nMicrobatches) {
    if (mode === "always") return true;
    if (mode === "except_last") return microbatch < nMicrobatches - 1;
    return false;
  }

  // Time a message takes from stage s to s + 1 (forward) and to s - 1 (backward).
  function delays(schedule, costs) {
    const rankOf = schedule.stageToRank;
    const k = schedule.nStages;
    const wire = costs.latency + costs.message_bytes / costs.bandwidth;
    const forward = [];
    const backward = [];
    for (let s = 0; s < k; s++) {
      forward.push(s + 1 < k && rankOf[s + 1] === rankOf[s] ? 0 : wire);
      backward.push(s > 0 && rankOf[s - 1] === rankOf[s] ? 0 : wire);
    }
    return [forward, backward];
  }

  function zeros(n) {
    return new Array(n).fill(0);
  }

  // Every rank runs its program in order: compute takes its stage's cost, a send takes no
  // time and its message arrives after its delay, a receive waits for its message. A
  // re-materialized micro-batch keeps only message_bytes after its forward; its R, right
  // before its gradient's receive, runs the forward again.
  function simulate(schedule, given, checkpoint = "never") {
    checkCheckpoint(checkpoint);
    const costs = costsOf(given);
    if (checkpoint !== "never" && !(schedule.recomputed && schedule.recomputed.size)) {
      const m = schedule.nMicrobatches;
      const all = Array.from({ length: m }, (_, i) => i);
      const picked = new Set(all.filter((i) => shouldCheckpoint(checkpoint, i, m)));
      schedule = api.addRecompute(schedule, picked);
    }
    const n = schedule.nStages;
    const m = schedule.nMicrobatches;
    const nRanks = schedule.programs.length;
    if (schedule.stageToRank.length !== n) {
      throw new Error(`stage_to_rank has ${schedule.stageToRank.length} entries for ${n} stages`);
    }
    const fCost = perStage(costs, "forward", n);
    const wCost = perStage(costs, "weight", n);
    let bCost = perStage(costs, "backward", n);
    if (!schedule.splitBackward) bCost = bCost.map((b, s) => b + wCost[s]);
    const actBytes = perStage(costs, "activation_bytes", n);
    const [fDelay, bDelay] = delays(schedule, costs);
    const scale = microbatchScales(costs, m);
    const times = (cost, microbatch) => (scale === null ? cost : cost * scale[microbatch]);
    const light = costs.message_bytes;
    const recompute = [];
    for (let i = 0; i < m; i++) {
      recompute.push(Boolean(schedule.backward && schedule.recomputed && schedule.recomputed.has(i)));
    }
    const release = schedule.splitBackward ? "W" : "B";
    const keeps = schedule.backward;

    const fArrival = new Array(n * m).fill(null);
    const bArrival = new Array(n * m).fill(null);
    const fWaiting = new Map();
    const bWaiting = new Map();
    const skipArrival = new Map();
    const skipWaiting = new Map();
    const next = zeros(nRanks); // index of the next action of each rank
    const clock = zeros(nRanks);
    const busy = zeros(nRanks);
    const live = zeros(n);
    const peak = zeros(n);
    const kept = zeros(n);
    const stagePeak = zeros(n);
    const rankBytes = zeros(nRanks);
    const rankPeak = zeros(nRanks);
    const spans = Array.from({ length: nRanks }, () => []);
    const memory = Array.from({ length: nRanks }, () => [[0, 0]]);
    const ready = [];
    for (let r = nRanks - 1; r >= 0; r--) ready.push(r);

    while (ready.length) {
      const r = ready.pop();
      let t = clock[r];
      let work = busy[r];
      let held = rankBytes[r];
      let heldPeak = rankPeak[r];
      const program = schedule.programs[r];
      const lane = spans[r];
      let i = next[r];
      for (; i < program.length; i++) {
        const a = program[i];
        const s = a.stage;
        const kind = a.kind;
        if (kind === "F") {
          const start = t;
          const cost = times(fCost[s], a.microbatch);
          t += cost;
          work += cost;
          lane.push({ action: a, start, end: t });
          if (keeps) {
            const count = (live[s] += 1);
            if (count > peak[s]) peak[s] = count;
            if (recompute[a.microbatch]) {
              kept[s] += 1;
              held += light;
            } else {
              held += actBytes[s];
            }
            if (held > heldPeak) heldPeak = held;
            const now = (count - kept[s]) * actBytes[s] + kept[s] * light;
            if (now > stagePeak[s]) stagePeak[s] = now;
            memory[r].push([start, held]);
          } else {
            peak[s] = 1;
            stagePeak[s] = actBytes[s];
            heldPeak = Math.max(heldPeak, held + actBytes[s]);
          }
        } else if (kind === "SEND_F" || kind === "SEND_B") {
          const forward = kind === "SEND_F";
          const slot = (forward ? s + 1 : s - 1) * m + a.microbatch;
          const arrival = t + (forward ? fDelay[s] : bDelay[s]);
          (forward ? fArrival : bArrival)[slot] = arrival;
          lane.push({ action: a, start: t, end: arrival });
          const waiting = forward ? fWaiting : bWaiting;
          if (waiting.has(slot)) {
            ready.push(waiting.get(slot));
            waiting.delete(slot);
          }
        } else if (kind === "RECV_F" || kind === "RECV_B") {
          const forward = kind === "RECV_F";
          const slot = s * m + a.microbatch;
          const at = (forward ? fArrival : bArrival)[slot];
          if (at === null) {
            (forward ? fWaiting : bWaiting).set(slot, r);
            break;
          }
          const start = t;
          if (at > t) t = at;
          lane.push({ action: a, start, end: t });
        } else if (kind === "SEND_SKIP" || kind === "SEND_SKIP_B") {
          // skips: the page's costs give them no bytes, only the link's latency between ranks
          const apart = schedule.stageToRank[s] !== schedule.stageToRank[a.peer];
          const arrival = t + (apart ? costs.latency : 0);
          const key = `${kind === "SEND_SKIP"} ${a.peer} ${s} ${a.microbatch}`;
          skipArrival.set(key, arrival);
          lane.push({ action: a, start: t, end: arrival });
          if (skipWaiting.has(key)) {
            ready.push(skipWaiting.get(key));
            skipWaiting.delete(key);
          }
        } else if (kind === "RECV_SKIP" || kind === "RECV_SKIP_B") {
          const key = `${kind === "RECV_SKIP"} ${s} ${a.peer} ${a.microbatch}`;
          if (!skipArrival.has(key)) {
            skipWaiting.set(key, r);
            break;
          }
          const start = t;
          if (skipArrival.get(key) > t) t = skipArrival.get(key);
          lane.push({ action: a, start, end: t });
        } else if (kind === "R") {
          const start = t;
          kept[s] -= 1;
          held += actBytes[s] - light;
          if (held > heldPeak) heldPeak = held;
          const now = (live[s] - kept[s]) * actBytes[s] + kept[s] * light;
          if (now > stagePeak[s]) stagePeak[s] = now;
          memory[r].push([start, held]);
          const cost = times(fCost[s], a.microbatch);
          t += cost;
          work += cost;
          lane.push({ action: a, start, end: t });
        } else if (kind === "B" || kind === "W") {
          const start = t;
          const cost = times(kind === "B" ? bCost[s] : wCost[s], a.microbatch);
          t += cost;
          work += cost;
          lane.push({ action: a, start, end: t });
          if (kind === release) {
            live[s] -= 1;
            held -= actBytes[s];
            memory[r].push([t, held]);
          }
        } else {
          throw new Error(`this page cannot simulate action ${api.actionName(a)}`);
        }
      }
      next[r] = i;
      clock[r] = t;
      busy[r] = work;
      rankBytes[r] = held;
      rankPeak[r] = heldPeak;
    }
    const stuck = [];
    next.forEach((i, r) => {
      const program = schedule.programs[r];
      if (i < program.length) stuck.push(`rank ${r} waits at ${api.actionName(program[i])}`);
    });
    if (stuck.length) throw new Error(`${schedule.name} deadlocks: ${stuck.join(", ")}`);

    const makespan = nRanks ? Math.max(...clock) : 0;
    const idle = busy.map((b) => makespan - b);
    const bubble = makespan > 0 ? idle.reduce((x, y) => x + y, 0) / (nRanks * makespan) : 0;
    return {
      schedule,
      checkpoint,
      makespan,
      busy,
      idle,
      bubble,
      peakLive: peak,
      peakActivationBytes: stagePeak,
      peakRankActivationBytes: rankPeak,
      spans,
      memory,
    };
  }

  // gpipe.planning.simulate.scenario: K ranks; interleaved cuts each rank's costs into v stages.
  function scenario(name, nRanks, nMicrobatches, given, virtualStages = 2) {
    const costs = costsOf(given);
    const v = api.stagesPerRank(name, virtualStages);
    if (v === 1) {
      return [api.getSchedule(name)(nRanks, nMicrobatches), costs];
    }
    if (!Number.isInteger(v) || v < 1) {
      throw new Error(`virtual_stages must be a positive integer, got ${v}`);
    }
    const schedule = api.getSchedule(name)(nRanks * v, nMicrobatches, nRanks);
    const split = {};
    for (const field of PER_STAGE) {
      const share = perStage(costs, field, nRanks).map((x) => x / v);
      split[field] = schedule.stageToRank.map((rank) => share[rank]);
    }
    return [schedule, { ...costs, ...split }];
  }

  // gpipe.planning.bubbles.split_costs: each rank's costs cut evenly into the stages it
  // holds in a given schedule (one read from a file, say).
  function splitCosts(schedule, given) {
    const costs = costsOf(given);
    const nRanks = schedule.programs.length;
    const perRank = schedule.nStages / nRanks;
    if (perRank === 1 && schedule.stageToRank.every((rank, stage) => rank === stage)) {
      return costs;
    }
    const split = {};
    for (const field of PER_STAGE) {
      const values = perStage(costs, field, nRanks);
      split[field] = schedule.stageToRank.map((rank) => values[rank] / perRank);
    }
    return { ...costs, ...split };
  }

  // gpipe.planning.closed_forms.closed_form_bubble: each schedule's own formula, or null.
  // The split-backward schedules leave each rank idle for a time beside its M (F+B+W).
  function closedFormBubble(name, k, m, v = 1, forward = 1, backward = 1, weight = 0) {
    api.getSchedule(name);
    if (!Number.isInteger(v) || v < 1) {
      throw new Error(`virtual_stages must be a positive integer, got ${v}`);
    }
    const [f, b, w] = [forward, backward, weight];
    const share = (idle) => {
      const total = m * (f + b + w) + idle;
      return total > 0 ? idle / total : null;
    };
    if (name === "gpipe" || name === "1f1b") return (k - 1) / (m + k - 1);
    if (name === "interleaved") return m % k === 0 ? (k - 1) / (v * m + k - 1) : null;
    if (name === "looped-bfs") return m >= k ? (k - 1) / (v * m + k - 1) : null;
    if (name === "zero-bubble") {
      return m >= k && w <= Math.min(f, b) ? share((k - 1) * (f + b - w)) : null;
    }
    if (name === "interleaved-zero-bubble") {
      return m % k || w > Math.min(f, b) ? null : share(((k - 1) * (f + b - w)) / v);
    }
    if (name === "zero-bubble-v") {
      return m < 2 * k - 1 || f > b || w > b ? null : share((k - 1) * Math.max(b / 2, b - w));
    }
    if (name === "dualpipe-v") {
      const holds = m >= 2 * k && b <= f && f <= b + w;
      return holds ? share(((k - 1) * Math.max(f, f + b - w)) / 2) : null;
    }
    if (name === "v-half" || name === "v-min") {
      if (m < api.fewestMicrobatches(name, k, v)) return null;
      if (k === 1) return 0;
      if (k > 2 || f !== b || b !== w) return null;
      return share(((name === "v-half" ? 2 + Math.floor((m + 1) / 2) : 2 * m + 1) * f) / 2);
    }
    return null;
  }

  // gpipe.planning.closed_forms.closed_form_peak: per rank, the most micro-batches'
  // activations held at once, in micro-batches of the rank's share; null where none.
  const PEAKS = {
    gpipe: (k, m) => m,
    "looped-bfs": (k, m) => m,
    "1f1b": (k, m, v, r) => Math.min(m, k - r),
    "zero-bubble": (k, m) => Math.min(m, k),
    interleaved: (k, m, v, r) => Math.min(m, k + (k - 1 - 2 * r) / v),
    "interleaved-zero-bubble": (k, m, v, r) => Math.min(m, k + (k - 1 - r) / v),
    "zero-bubble-v": (k, m, v, r) => Math.min(m, (m + r + 1) / 2, k),
    "dualpipe-v": (k) => k + 1 / 2,
    "v-half": (k, m) => Math.min(api.vHalfCap(k), 2 * m) / 2,
    "v-min": (k, m) => Math.min(api.vMinCap(k), 2 * m) / 2,
  };

  function closedFormPeak(name, k, m, v = 1) {
    api.getSchedule(name);
    if (!Number.isInteger(v) || v < 1) {
      throw new Error(`virtual_stages must be a positive integer, got ${v}`);
    }
    const traits = api.TRAITS[name];
    const fewest = api.fewestMicrobatches(name, k, v);
    const form = PEAKS[name];
    if (!form || (traits.perRound && m % k) || m < fewest) return null;
    return Array.from({ length: k }, (_, r) => form(k, m, v, r));
  }

  Object.assign(api, {
    CHECKPOINT_MODES,
    closedFormBubble,
    closedFormPeak,
    costsOf,
    microbatchScales,
    perStage,
    scenario,
    shouldCheckpoint,
    simulate,
    splitCosts,
    unevenMicrobatches,
  });
})(globalThis);
