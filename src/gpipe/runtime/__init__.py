"""One stage's work: stages, the executor of a schedule, re-materialization, weight
gradients, micro-batches, deferred BatchNorm and the timeline of what ran."""
