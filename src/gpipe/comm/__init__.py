"""Moving tensors between stages: the transport protocol, torch.distributed point-to-point,
named pipes, envelopes, payloads and GPU copy streams; and the process group."""

from gpipe.comm.distributed import DistributedTransport
from gpipe.comm.in_process import InProcessTransport
from gpipe.comm.named_pipes import PipeClosed, Pipes, PipeTimeout, open_pipes
from gpipe.comm.process_group import default_device, init_process_group, rank_device
from gpipe.comm.transport import Message, Transport

__all__ = [
    "DistributedTransport",
    "InProcessTransport",
    "Message",
    "PipeClosed",
    "PipeTimeout",
    "Pipes",
    "Transport",
    "default_device",
    "init_process_group",
    "open_pipes",
    "rank_device",
]
