"""Tools that predict before a run: where to cut, what fits in memory, how long a schedule
takes and which configuration to pick. They read schedules and costs, never run a step."""
