"""Not a module: balancing lives in ``gpipe.planning.balancing``; importing this name says so."""

raise ImportError(
    "gpipe_balancing does not exist: balancing lives in gpipe.planning.balancing "
    "(from gpipe.planning.balancing import balance_by_time, balance_by_size)"
)
