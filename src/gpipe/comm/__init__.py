"""Moving tensors between stages: the transport protocol, torch.distributed point-to-point,
named pipes, envelopes, payloads and GPU copy streams; and the process group with the
decisions all ranks share."""

from gpipe.comm.agreement import on_first_rank
from gpipe.comm.distributed import DistributedTransport
from gpipe.comm.named_pipes import PipeClosed, Pipes, PipeTimeout, open_pipes
from gpipe.comm.process_group import (
    bounded_wait,
    default_device,
    finish_process_group,
    init_process_group,
    rank_device,
)
from gpipe.comm.transport import InProcessTransport, Message, Transport

__all__ = [
    "DistributedTransport",
    "InProcessTransport",
    "Message",
    "PipeClosed",
    "PipeTimeout",
    "Pipes",
    "Transport",
    "bounded_wait",
    "default_device",
    "finish_process_group",
    "init_process_group",
    "on_first_rank",
    "open_pipes",
    "rank_device",
]
