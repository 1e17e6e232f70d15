"""Not a module: balancing lives in ``gpipe.balance``; importing this name says so."""

raise ImportError(
    "gpipe_balancing does not exist: balancing lives in gpipe.balance "
    "(from gpipe.balance import balance_by_time, balance_by_size)"
)
