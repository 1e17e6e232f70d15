"""Tools that predict before a run: where to cut, what fits in memory, how long a schedule takes, which configuration to pick."""
