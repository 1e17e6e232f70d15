"""The name torchgpipe's first releases gave their balancing tools, kept for their users.

``import gpipe_balancing`` works as ``import gpipe.balance`` (now ``gpipe.planning.balancing``)
and warns that the name goes away in the next major version.
"""

import warnings

from gpipe.planning.balancing import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    layer_times,
    partition,
)

__all__ = ["balance_by_params", "balance_by_size", "balance_by_time", "layer_times", "partition"]

warnings.warn(
    "gpipe_balancing is deprecated and goes away in gpipe 1.0: import gpipe.balance "
    "(from gpipe.balance import balance_by_time, balance_by_size)",
    DeprecationWarning,
    stacklevel=2,
)
