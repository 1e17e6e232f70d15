"""Moving tensors between stages: the transport protocol, torch.distributed point-to-point,
named pipes, envelopes, payloads and GPU copy streams."""
