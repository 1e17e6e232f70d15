// gpipe's schedule generators (gpipe/schedules/) in JavaScript, action for action, so that the
// page can compute schedules offline. tests/view/test_view_parity.py holds them to the Python ones.
(function (root) {
  "use strict";
  const api = root.gpipeView || (root.gpipeView = {});

  const F = "F";
  const B = "B";
  const W = "W";
  const R = "R";
  const COMPUTE = new Set([F, B, W, R]);
  const KINDS = new Set([F, B, W, R, "SEND_F", "RECV_F", "SEND_B", "RECV_B"]);
  // skip connections (gpipe.skip): sent straight to a later stage, named by "@peer"
  const SKIP_KINDS = new Set(["SEND_SKIP", "RECV_SKIP", "SEND_SKIP_B", "RECV_SKIP_B"]);

  function action(stage, kind, microbatch, peer = null) {
    return peer === null ? { stage, kind, microbatch } : { stage, kind, microbatch, peer };
  }

  // "1F0": stage 1, forward, micro-batch 0, as Python's Action prints; "0SEND_SKIP3@2".
  function actionName(a) {
    const name = `${a.stage}${a.kind}${a.microbatch}`;
    return a.peer === undefined ? name : `${name}@${a.peer}`;
  }

  function parseAction(text) {
    const match = /^(\d+)([A-Z_]+?)(\d+)(?:@(\d+))?$/.exec(text);
    const known = match && (match[4] === undefined ? KINDS : SKIP_KINDS).has(match[2]);
    if (!known) {
      throw new Error(`unknown action ${JSON.stringify(text)}; this page knows ${[...KINDS]}`);
    }
    const peer = match[4] === undefined ? null : Number(match[4]);
    return action(Number(match[1]), match[2], Number(match[3]), peer);
  }

  function isCompute(a) {
    return COMPUTE.has(a.kind);
  }

  function range(n) {
    return Array.from({ length: Math.max(0, n) }, (_, i) => i);
  }

  // Each compute action of one stage, with the receives before it and the sends after it.
  function withCommunication(stage, nStages, compute) {
    const program = [];
    const first = stage === 0;
    const last = stage === nStages - 1;
    for (const [kind, mb] of compute) {
      if (kind === F) {
        if (!first) program.push(action(stage, "RECV_F", mb));
        program.push(action(stage, F, mb));
        if (!last) program.push(action(stage, "SEND_F", mb));
      } else if (kind === B) {
        if (!last) program.push(action(stage, "RECV_B", mb));
        program.push(action(stage, B, mb));
        if (!first) program.push(action(stage, "SEND_B", mb));
      } else {
        program.push(action(stage, kind, mb));
      }
    }
    return program;
  }

  function isPositiveInt(n) {
    return Number.isInteger(n) && n >= 1;
  }

  function checkSizes(nStages, nMicrobatches) {
    if (!isPositiveInt(nStages)) {
      throw new Error(`n_stages must be a positive integer, got ${nStages}`);
    }
    if (!isPositiveInt(nMicrobatches)) {
      throw new Error(`n_microbatches must be a positive integer, got ${nMicrobatches}`);
    }
  }

  function schedule(name, nStages, nMicrobatches, programs, stageToRank, splitBackward) {
    return {
      name,
      nStages,
      nMicrobatches,
      programs,
      stageToRank,
      backward: true,
      splitBackward: Boolean(splitBackward),
    };
  }

  // GPipe fill-drain: all forwards, then all backwards in reverse order.
  function gpipe(nStages, nMicrobatches) {
    checkSizes(nStages, nMicrobatches);
    const forwards = range(nMicrobatches).map((i) => [F, i]);
    const backwards = range(nMicrobatches)
      .reverse()
      .map((i) => [B, i]);
    const programs = range(nStages).map((s) =>
      withCommunication(s, nStages, forwards.concat(backwards)),
    );
    return schedule("gpipe", nStages, nMicrobatches, programs, range(nStages));
  }

  // Warm-up forwards, then one forward and one backward in turn, then the last backwards.
  function oneFOneBOrder(stage, nStages, nMicrobatches) {
    const warmup = Math.min(nStages - stage - 1, nMicrobatches);
    const order = range(warmup).map((i) => [F, i]);
    for (let i = 0; i < nMicrobatches - warmup; i++) {
      order.push([F, warmup + i], [B, i]);
    }
    for (let i = nMicrobatches - warmup; i < nMicrobatches; i++) order.push([B, i]);
    return order;
  }

  function oneFOneB(nStages, nMicrobatches) {
    checkSizes(nStages, nMicrobatches);
    const programs = range(nStages).map((s) =>
      withCommunication(s, nStages, oneFOneBOrder(s, nStages, nMicrobatches)),
    );
    return schedule("1f1b", nStages, nMicrobatches, programs, range(nStages));
  }

  // ZB-H1: 1F1B with B split into B (input gradients) and W (weight gradients); stage s runs
  // the W of micro-batch i after the B of micro-batch i + s.
  function zeroBubbleH1(nStages, nMicrobatches) {
    checkSizes(nStages, nMicrobatches);
    const programs = range(nStages).map((s) => {
      const order = [];
      let weights = 0;
      for (const [kind, i] of oneFOneBOrder(s, nStages, nMicrobatches)) {
        order.push([kind, i]);
        if (kind === B && i - weights >= s) {
          order.push([W, weights]);
          weights += 1;
        }
      }
      for (let i = weights; i < nMicrobatches; i++) order.push([W, i]);
      return withCommunication(s, nStages, order);
    });
    return schedule("zero-bubble", nStages, nMicrobatches, programs, range(nStages), true);
  }

  // Each rank's program from its order of [kind, stage, micro-batch] compute actions.
  function programsOf(orders, nStages) {
    return orders.map((order) =>
      order.flatMap(([kind, stage, mb]) => withCommunication(stage, nStages, [[kind, mb]])),
    );
  }

  function rankCount(nStages, nRanks, name) {
    const k = nRanks === undefined || nRanks === null ? nStages : nRanks;
    if (!isPositiveInt(k) || nStages % k) {
      throw new Error(
        `${name} needs a number of stages that is a multiple of the number of ranks, ` +
          `got ${nStages} stages for ${k} ranks`,
      );
    }
    return k;
  }

  // Interleaved 1F1B: rank r holds stages r, r + K, r + 2K, ...; micro-batches in groups of
  // K. With split, interleaved zero bubble: B and W apart, rank r's W r backwards late.
  function loopedOneFOneB(name, nStages, nMicrobatches, nRanks, split) {
    checkSizes(nStages, nMicrobatches);
    const k = rankCount(nStages, nRanks, name);
    if (nMicrobatches % k) {
      throw new Error(
        `${name} needs a number of micro-batches that is a multiple of the number ` +
          `of ranks (${k}), got ${nMicrobatches}`,
      );
    }
    const v = nStages / k;
    const total = nMicrobatches * v;
    const forwardOf = (rank, j) => [
      (Math.floor(j / k) % v) * k + rank,
      Math.floor(j / (k * v)) * k + (j % k),
    ];
    const backwardOf = (rank, j) => [
      (v - 1 - (Math.floor(j / k) % v)) * k + rank,
      Math.floor(j / (k * v)) * k + (j % k),
    ];
    const orders = range(k).map((rank) => {
      const warmup = Math.min((k - rank - 1) * 2 + (v - 1) * k, total);
      const order = range(warmup).map((j) => [F, ...forwardOf(rank, j)]);
      for (let i = 0; i < total; i++) {
        if (warmup + i < total) order.push([F, ...forwardOf(rank, warmup + i)]);
        order.push([B, ...backwardOf(rank, i)]);
        if (split && i >= rank) order.push([W, ...backwardOf(rank, i - rank)]);
      }
      if (split) {
        for (let j = Math.max(total - rank, 0); j < total; j++) {
          order.push([W, ...backwardOf(rank, j)]);
        }
      }
      return order;
    });
    const stageToRank = range(nStages).map((s) => s % k);
    return schedule(name, nStages, nMicrobatches, programsOf(orders, nStages), stageToRank, split);
  }

  function interleaved(nStages, nMicrobatches, nRanks) {
    return loopedOneFOneB("interleaved", nStages, nMicrobatches, nRanks, false);
  }

  function interleavedZeroBubble(nStages, nMicrobatches, nRanks) {
    return loopedOneFOneB("interleaved-zero-bubble", nStages, nMicrobatches, nRanks, true);
  }

  // Looped BFS: all micro-batches through one of a rank's stages before the next.
  function loopedBfs(nStages, nMicrobatches, nRanks) {
    checkSizes(nStages, nMicrobatches);
    const k = rankCount(nStages, nRanks, "looped-bfs");
    const orders = range(k).map((rank) => {
      const mine = range(nStages / k).map((c) => c * k + rank);
      const order = [];
      for (const s of mine) for (const i of range(nMicrobatches)) order.push([F, s, i]);
      for (const s of [...mine].reverse()) {
        for (const i of range(nMicrobatches)) order.push([B, s, i]);
      }
      return order;
    });
    const stageToRank = range(nStages).map((s) => s % k);
    return schedule("looped-bfs", nStages, nMicrobatches, programsOf(orders, nStages), stageToRank);
  }

  // gpipe.errors.counted: "1 rank", "2 ranks", so that a refusal about one rank reads right.
  function counted(count, word) {
    return `${count} ${count === 1 ? word : `${word}s`}`;
  }

  // A V of 2K stages on K ranks: rank r holds stages r and 2K - 1 - r (its chunks 0 and 1).
  function checkV(name, nStages, nRanks) {
    const given = !(nRanks === undefined || nRanks === null);
    if (nStages % 2 || (given && nStages !== 2 * nRanks)) {
      const expected = given ? String(2 * nRanks) : "an even number of";
      const ranks = given ? ` for ${counted(nRanks, "rank")}` : "";
      throw new Error(
        `${name} places two stages per rank in a V: it needs ${expected} stages, ` +
          `got ${nStages}${ranks}`,
      );
    }
    return nStages / 2;
  }

  function vStageToRank(nStages) {
    return range(nStages).map((s) => (s < nStages / 2 ? s : nStages - 1 - s));
  }

  // One rank's counters per chunk; the n-th forward (B, W) of a chunk is of micro-batch n.
  function chunks(rank, nStages) {
    const c = {
      stage: [rank, nStages - 1 - rank], forwards: [0, 0], backwards: [0, 0], weights: [0, 0],
      putOff: [], order: [],
    };
    c.forward = (chunk) => c.order.push([F, c.stage[chunk], c.forwards[chunk]++]);
    c.weight = (chunk) => c.order.push([W, c.stage[chunk], c.weights[chunk]++]);
    c.backward = (chunk, weightNow = false) => {
      c.order.push([B, c.stage[chunk], c.backwards[chunk]++]);
      if (weightNow) c.weight(chunk);
    };
    c.split = (chunk, split) => {
      c.backward(chunk, !split);
      if (split) c.putOff.push(chunk);
    };
    c.weightPutOff = () => c.weight(c.putOff.shift());
    c.weightsLeft = (chunk) => {
      while (c.weights[chunk] < c.backwards[chunk]) c.weight(chunk);
    };
    return c;
  }

  // ZB-V (gpipe.schedules.v_shape.zero_bubble_v), laid out for at least 2K - 1 micro-batches.
  function zeroBubbleV(nStages, nMicrobatches, nRanks) {
    checkSizes(nStages, nMicrobatches);
    const k = checkV("zero-bubble-v", nStages, nRanks);
    const laidOut = Math.max(nMicrobatches, 2 * k - 1);
    const orders = range(k).map((rank) => {
      const c = chunks(rank, nStages);
      for (let i = 0; i < 2 * (k - rank) - 1; i++) c.forward(0);
      for (let i = 0; i < rank; i++) {
        c.forward(1);
        c.forward(0);
      }
      for (let i = 0; i < k - rank; i++) {
        c.forward(1);
        c.backward(1, true);
      }
      while (c.forwards[1] < c.forwards[0] || c.forwards[0] < laidOut) {
        if (c.forwards[0] < laidOut) c.forward(0);
        c.backward(0, true);
        c.forward(1);
        c.backward(1, true);
      }
      for (let i = 0; i < rank; i++) {
        c.backward(0);
        c.backward(1);
      }
      for (let i = 0; i < k - rank; i++) {
        c.backward(0);
        c.weight(0);
      }
      c.weightsLeft(1);
      c.weightsLeft(0);
      return c.order.filter((a) => a[2] < nMicrobatches);
    });
    return schedule(
      "zero-bubble-v", nStages, nMicrobatches, programsOf(orders, nStages),
      vStageToRank(nStages), true,
    );
  }

  // DualPipeV (gpipe.schedules.v_shape.dualpipe_v), M >= 2K.
  function dualpipeV(nStages, nMicrobatches, nRanks) {
    checkSizes(nStages, nMicrobatches);
    const k = checkV("dualpipe-v", nStages, nRanks);
    if (nMicrobatches < nStages) {
      throw new Error(
        `dualpipe-v needs at least 2K = ${nStages} micro-batches for ${counted(k, "rank")}, ` +
          `got ${nMicrobatches}`,
      );
    }
    const orders = range(k).map((rank) => {
      const c = chunks(rank, nStages);
      const rest = k - rank - 1;
      for (let i = 0; i < 2 * rest; i++) c.forward(0);
      for (let i = 0; i < rank + 1; i++) {
        c.forward(0);
        c.forward(1);
      }
      for (let i = 0; i < rest; i++) {
        c.split(1, true);
        c.weightPutOff();
        c.forward(1);
      }
      for (let i = 0; i < nMicrobatches - 2 * k + rank + 1; i++) {
        c.forward(0);
        c.split(1, false);
        c.forward(1);
        c.split(0, false);
      }
      for (let i = 0; i < rest; i++) {
        c.split(1, false);
        c.forward(1);
        c.split(0, false);
      }
      let split = false;
      const half = Math.floor((rank + 1) / 2);
      for (let i = 0; i < rank + 1; i++) {
        if (i === half && rank % 2 === 1) split = true;
        c.split(1, split);
        if (i === half && rank % 2 === 0) split = true;
        c.split(0, split);
      }
      for (let i = 0; i < rest; i++) {
        c.weightPutOff();
        c.split(0, true);
      }
      for (let i = 0; i < rank + 1; i++) c.weightPutOff();
      return c.order;
    });
    return schedule(
      "dualpipe-v", nStages, nMicrobatches, programsOf(orders, nStages),
      vStageToRank(nStages), true,
    );
  }

  // gpipe.schedules.v_memory: V-Half and V-Min, each rank capped at `cap` chunk-sized
  // micro-batches, ordered by a list schedule played in unit time.
  const vHalfCap = (k) => k + 1;
  const vMinCap = (k) => Math.max(2, Math.floor((2 * k + 4) / 3));
  const vMinFewest = (k) => Math.floor(vMinCap(k) / 2) + 1;

  function cappedV(name, nStages, nMicrobatches, nRanks, cap) {
    checkSizes(nStages, nMicrobatches);
    const k = checkV(name, nStages, nRanks);
    const m = nMicrobatches;
    const never = 12 * m * k + 4 * nStages;
    const forwardEnd = range(nStages).map(() => range(m).map(() => never));
    const backwardEnd = range(nStages).map(() => range(m).map(() => never));
    const ranks = range(k).map((r) => ({
      stage: [r, nStages - 1 - r], forwards: [0, 0], backwards: [0, 0], weights: [0, 0],
      live: 0, order: [],
    }));
    const fits = (r, chunk) =>
      chunk === 1 || r.forwards[0] === r.forwards[1] ? r.live < cap : r.live + 1 < cap;
    // What rank r runs at `step`: [kind, chunk], or null to wait.
    const next = (r, step) => {
      let best = null;
      for (const chunk of [1, 0]) {
        const mb = r.backwards[chunk];
        const stage = r.stage[chunk];
        const ready = stage === nStages - 1 || backwardEnd[stage + 1][mb] <= step;
        if (mb < r.forwards[chunk] && ready && (best === null || mb < best[0])) best = [mb, chunk];
      }
      if (best !== null) return [B, best[1]];
      for (const chunk of [1, 0]) {
        const mb = r.forwards[chunk];
        const stage = r.stage[chunk];
        if (mb < m && fits(r, chunk) && (stage === 0 || forwardEnd[stage - 1][mb] <= step)) {
          if (best === null || mb < best[0]) best = [mb, chunk];
        }
      }
      if (best !== null) return [F, best[1]];
      for (const chunk of [1, 0]) {
        const mb = r.weights[chunk];
        if (mb < r.backwards[chunk] && (best === null || mb < best[0])) best = [mb, chunk];
      }
      return best === null ? null : [W, best[1]];
    };
    let left = 6 * m * k;
    for (let step = 0; left; step++) {
      let ran = 0;
      for (const r of ranks) {
        const chosen = next(r, step);
        if (chosen === null) continue;
        const [kind, chunk] = chosen;
        const stage = r.stage[chunk];
        let mb;
        if (kind === F) {
          mb = r.forwards[chunk]++;
          r.live += 1;
          forwardEnd[stage][mb] = step + 1;
        } else if (kind === B) {
          mb = r.backwards[chunk]++;
          backwardEnd[stage][mb] = step + 1;
        } else {
          mb = r.weights[chunk]++;
          r.live -= 1;
        }
        r.order.push([kind, stage, mb]);
        ran += 1;
      }
      if (!ran && step > 0) throw new Error(`${name}: no rank can move at step ${step} (cap ${cap})`);
      left -= ran;
    }
    return schedule(
      name, nStages, nMicrobatches, programsOf(ranks.map((r) => r.order), nStages),
      vStageToRank(nStages), true,
    );
  }

  function vHalf(nStages, nMicrobatches, nRanks) {
    const k = checkV("v-half", nStages, nRanks);
    return cappedV("v-half", nStages, nMicrobatches, nRanks, vHalfCap(k));
  }

  function vMin(nStages, nMicrobatches, nRanks) {
    const k = checkV("v-min", nStages, nRanks);
    checkSizes(nStages, nMicrobatches);
    const fewest = vMinFewest(k);
    if (nMicrobatches < fewest) {
      throw new Error(
        `v-min needs at least ${fewest} micro-batches for ${counted(k, "rank")} (with ` +
          `fewer, none reaches its cap of ${vMinCap(k)} half-stage micro-batches: use ` +
          `zero-bubble-v), got ${nMicrobatches}`,
      );
    }
    return cappedV("v-min", nStages, nMicrobatches, nRanks, vMinCap(k));
  }

  const SCHEDULES = {
    gpipe,
    "1f1b": oneFOneB,
    "zero-bubble": zeroBubbleH1,
    interleaved,
    "interleaved-zero-bubble": interleavedZeroBubble,
    "looped-bfs": loopedBfs,
    "zero-bubble-v": zeroBubbleV,
    "dualpipe-v": dualpipeV,
    "v-half": vHalf,
    "v-min": vMin,
  };

  // gpipe.schedules.registry's traits: where a schedule's stages sit, and what M it takes.
  const TRAITS = {
    gpipe: { placement: "one" },
    "1f1b": { placement: "one" },
    "zero-bubble": { placement: "one", split: true },
    interleaved: { placement: "looped", perRound: true },
    "interleaved-zero-bubble": { placement: "looped", split: true, perRound: true },
    "looped-bfs": { placement: "looped" },
    "zero-bubble-v": { placement: "v", split: true },
    "dualpipe-v": { placement: "v", split: true, perStage: true },
    "v-half": { placement: "v", split: true },
    "v-min": { placement: "v", split: true, fewest: vMinFewest },
  };

  // How many stages each rank holds when v are asked for (a V holds two, whatever is asked).
  function stagesPerRank(name, virtualStages) {
    const placement = TRAITS[name].placement;
    if (placement === "v") return 2;
    return placement === "looped" ? virtualStages : 1;
  }

  // Traits.fewest_microbatches: the fewest micro-batches a schedule runs on k ranks.
  function fewestMicrobatches(name, k, virtualStages = 1) {
    const traits = TRAITS[name];
    if (traits.fewest) return traits.fewest(k);
    if (traits.perStage) return k * stagesPerRank(name, virtualStages);
    return traits.perRound ? k : 1;
  }

  // gpipe.schedules.add_recompute: each recomputed micro-batch's forward runs again (R) right
  // before its backward's receives, ahead of the gradient.
  function addRecompute(schedule, recomputed) {
    if (!recomputed.size || !schedule.backward) return schedule;
    const programs = schedule.programs.map((program) => {
      const out = [];
      for (const a of program) {
        if (a.kind === B && recomputed.has(a.microbatch)) {
          let at = out.length;
          while (
            at > 0 &&
            (out[at - 1].kind === "RECV_B" || out[at - 1].kind === "RECV_SKIP_B") &&
            out[at - 1].stage === a.stage &&
            out[at - 1].microbatch === a.microbatch
          ) {
            at -= 1;
          }
          out.splice(at, 0, action(a.stage, R, a.microbatch));
        }
        out.push(a);
      }
      return out;
    });
    const all = new Set([...(schedule.recomputed || []), ...recomputed]);
    return { ...schedule, programs, recomputed: all };
  }

  function getSchedule(name) {
    if (!Object.prototype.hasOwnProperty.call(SCHEDULES, name)) {
      const known = Object.keys(SCHEDULES).sort();
      throw new Error(`schedule must be one of ${known.join(", ")}, got ${JSON.stringify(name)}`);
    }
    return SCHEDULES[name];
  }

  // A schedule given as data, e.g. the one a measured run ran: programs of action names.
  function scheduleFromData(data) {
    return {
      name: data.name,
      nStages: data.n_stages,
      nMicrobatches: data.n_microbatches,
      programs: data.programs.map((program) => program.map(parseAction)),
      stageToRank: data.stage_to_rank,
      backward: data.backward,
      splitBackward: data.split_backward,
      recomputed: new Set(data.recomputed || []),
    };
  }

  Object.assign(api, {
    SCHEDULES,
    TRAITS,
    dualpipeV,
    fewestMicrobatches,
    interleavedZeroBubble,
    loopedBfs,
    zeroBubbleV,
    actionName,
    addRecompute,
    getSchedule,
    gpipe,
    interleaved,
    isCompute,
    oneFOneB,
    parseAction,
    scheduleFromData,
    stagesPerRank,
    vHalf,
    vHalfCap,
    vMin,
    vMinCap,
    withCommunication,
    zeroBubbleH1,
  });
})(globalThis);
