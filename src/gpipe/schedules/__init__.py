"""Schedules as data: per-rank ordered lists of actions, their generators and a validator.

``ir`` holds the actions and the ``Schedule``; one module per family generates schedules
(``fill_drain``, ``one_f_one_b``, ``zero_bubble``, ``interleaved``, ``looped_bfs``, and
``v_shape`` for the schedules that place two stages per rank in a V, ``v_memory`` for
those of them whose memory is capped, ``seq_chunked`` for micro-batches cut along their
sequence); ``csv_format`` reads
and writes them as PyTorch's schedule files; ``rewrite`` adds skip and
recomputation actions to any of them; ``validate`` checks one can run; ``registry`` names
them and declares their traits. A new schedule is a generator module and a ``register`` call.
"""

from gpipe.schedules.csv_format import from_csv, read_csv, to_csv
from gpipe.schedules.fill_drain import clock_cycles, forward_only, gpipe
from gpipe.schedules.interleaved import interleaved, interleaved_zero_bubble
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
from gpipe.schedules.looped_bfs import looped_bfs
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
from gpipe.schedules.seq_chunked import SEQ_CHUNKED, seq_chunked
from gpipe.schedules.v_memory import v_half, v_min
from gpipe.schedules.v_shape import dualpipe_v, v_stage_to_rank, zero_bubble_v
from gpipe.schedules.validate import execution_order, validate
from gpipe.schedules.zero_bubble import zero_bubble_h1

__all__ = [
    "FORWARD_KINDS",
    "RECV_KINDS",
    "RECV_OF",
    "SEND_KINDS",
    "SEND_OF",
    "SCHEDULES",
    "SEQ_CHUNKED",
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
    "dualpipe_v",
    "clock_cycles",
    "execution_order",
    "forward_only",
    "from_csv",
    "get_schedule",
    "gpipe",
    "interleaved",
    "interleaved_zero_bubble",
    "looped_bfs",
    "one_f_one_b",
    "read_csv",
    "register",
    "seq_chunked",
    "to_csv",
    "traits",
    "v_half",
    "v_min",
    "v_stage_to_rank",
    "validate",
    "zero_bubble_h1",
    "zero_bubble_v",
]
