"""torchgpipe's ``balance`` module, by its name: ``from gpipe.balance import balance_by_time``.

The balancing tools live in ``gpipe.planning.balancing``; this module gives torchgpipe's
scripts the name they import.
"""

from gpipe.planning.balancing import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    layer_times,
    partition,
)

__all__ = ["balance_by_params", "balance_by_size", "balance_by_time", "layer_times", "partition"]
