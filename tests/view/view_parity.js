// Runs the page's own schedule.js and simulate.js in node on the cases given as JSON on stdin
// ({"scripts": [paths], "cases": [...]}) and prints what they compute, for
// tests/view/test_view_parity.py to hold against gpipe.schedules and gpipe.planning.simulate.
"use strict";
const fs = require("fs");

const input = JSON.parse(fs.readFileSync(0, "utf8"));
for (const path of input.scripts) require(path);
const G = globalThis.gpipeView;

function run(c) {
  let schedule;
  let costs;
  try {
    if (c.schedule_data) {
      schedule = G.scheduleFromData(c.schedule_data);
      costs = c.split ? G.splitCosts(schedule, c.costs) : c.costs; // costs per rank, as typed
    } else {
      [schedule, costs] = G.scenario(c.schedule, c.stages, c.chunks, c.costs, c.virtual_stages);
    }
  } catch (err) {
    return { error: err.message };
  }
  const result = G.simulate(schedule, costs, c.checkpoint);
  return {
    programs: schedule.programs.map((p) => p.map(G.actionName)),
    stage_to_rank: schedule.stageToRank,
    split_backward: schedule.splitBackward,
    simulated: result.schedule.programs.map((p) => p.map(G.actionName)),
    spans: result.spans.map((lane) => lane.map((s) => [G.actionName(s.action), s.start, s.end])),
    makespan: result.makespan,
    busy: result.busy,
    idle: result.idle,
    bubble: result.bubble,
    peak_live: result.peakLive,
    peak_activation_bytes: result.peakActivationBytes,
    peak_rank_activation_bytes: result.peakRankActivationBytes,
    memory_top: result.memory.map((points) => Math.max(...points.map((p) => p[1]))),
    closed_form: c.schedule_data || [c.costs.forward, c.costs.backward, c.costs.weight].some(Array.isArray) ||
      G.unevenMicrobatches(c.costs)
      ? null
      : G.closedFormBubble(
          c.schedule,
          c.stages,
          c.chunks,
          G.stagesPerRank(c.schedule, c.virtual_stages),
          c.costs.forward,
          c.costs.backward,
          c.costs.weight,
        ),
    closed_form_peak: c.schedule_data
      ? null
      : G.closedFormPeak(c.schedule, c.stages, c.chunks, G.stagesPerRank(c.schedule, c.virtual_stages)),
  };
}

process.stdout.write(JSON.stringify(input.cases.map(run)));
