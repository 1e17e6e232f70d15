"""Schedules as data: per-rank ordered lists of actions, their generators and a validator.

``ir`` holds the actions and the ``Schedule``; one module per family generates schedules
(``fill_drain``, ``one_f_one_b``, ``zero_bubble``, ``interleaved``); ``rewrite`` adds skip and
recomputation actions to any of them; ``validate`` checks one can run; ``registry`` names
them and declares their traits. A new schedule is a generator module and a ``register`` call.
"""

from gpipe.schedules.fill_drain import clock_cycles, forward_only, gpipe
from gpipe.schedules.interleaved import interleaved
from gpipe.schedules.ir import (
    FORWARD_KINDS,
    RECV_KINDS,
    RECV_OF,
    SEND_KINDS,
    SEND_OF,
    Action,
    Kind,
    Schedule,
    ScheduleError,
)
from gpipe.schedules.one_f_one_b import one_f_one_b
from gpipe.schedules.registry import (
    SCHEDULES,
    Generator,
    Placement,
    Traits,
    build,
    get_schedule,
    register,
    traits,
)
from gpipe.schedules.rewrite import add_recompute, add_skips
from gpipe.schedules.validate import execution_order, validate
from gpipe.schedules.zero_bubble import zero_bubble_h1

__all__ = [
    "FORWARD_KINDS",
    "RECV_KINDS",
    "RECV_OF",
    "SEND_KINDS",
    "SEND_OF",
    "SCHEDULES",
    "Action",
    "Generator",
    "Kind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "Traits",
    "add_recompute",
    "add_skips",
    "build",
    "clock_cycles",
    "execution_order",
    "forward_only",
    "get_schedule",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "register",
    "traits",
    "validate",
    "zero_bubble_h1",
]
