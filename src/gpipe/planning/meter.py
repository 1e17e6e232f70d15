"""Measuring what a run holds for backward: the live bytes of tensors saved for backward and
of every layer's inputs and outputs, parameters left out, as ``memory.plan`` predicts them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from gpipe.planning.storages import storage_key, tensors_in
from gpipe.runtime import seq_chunks
from gpipe.skip.tracker import observe

__all__ = ["ActivationMeter"]


class ActivationMeter:
    """Peak live bytes of activations in a run: tensors autograd saves for backward, the
    inputs and outputs of ``module``'s layers (in sub-sequences too) and the tensors its
    skippable layers stash and pop or its sub-sequences carry, each storage once, parameters
    and buffers left out. ``with meter: ...`` watches a
    region; ``peak`` and ``saved_peak`` (saved tensors alone) hold the largest values seen.

    What the layers save is seen on whichever thread runs them (saved-tensor hooks are
    per thread, so each layer call installs them for itself); what is saved outside the
    layers, a loss for one, only on the thread that entered the meter."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._skip = {storage_key(t) for t in [*module.parameters(), *module.buffers()]}
        self._live: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self.peak = 0
        self.saved_peak = 0
        self._stack = contextlib.ExitStack()

    def _track(self, tensors: Iterable[Tensor], saved: bool) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._skip or t.is_meta:
                continue
            known = self._live.get(key)
            if known is None or known[0].expired():
                self._live[key] = (StorageWeakRef(storage), storage.nbytes(), saved)
            elif saved and not known[2]:
                self._live[key] = (known[0], known[1], True)
        self._sample()

    def _sample(self) -> None:
        total = saved = 0
        for key, (ref, nbytes, was_saved) in list(self._live.items()):
            if ref.expired():
                self._live.pop(key, None)  # another thread may have dropped it already
                continue
            total += nbytes
            saved += nbytes if was_saved else 0
        self.peak = max(self.peak, total)
        self.saved_peak = max(self.saved_peak, saved)

    def __enter__(self) -> ActivationMeter:
        def pack(t: Tensor) -> Tensor:
            self._track([t], saved=True)
            return t.detach()  # the tensor itself would tie an output to its own graph

        local = threading.local()

        def enter(layer: nn.Module, args: Any) -> None:
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            hooks.__enter__()
            local.__dict__.setdefault("hooks", []).append(hooks)

        def leave(layer: nn.Module, args: Any, output: Any) -> None:
            local.hooks.pop().__exit__(None, None, None)

        def after(layer: nn.Module, args: Any, output: Any) -> None:
            self._track([*tensors_in(args), *tensors_in(output)], saved=False)

        stack = self._stack
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(observe(lambda t: self._track([t], saved=False)))  # skip tensors
        # sub-sequences: their layers' inputs and outputs, and the keys and values carried
        stack.enter_context(seq_chunks.observe(lambda ts: self._track(ts, saved=False)))
        for layer in self._module.children():
            stack.callback(layer.register_forward_pre_hook(enter).remove)
            stack.callback(layer.register_forward_hook(leave, always_call=True).remove)
            stack.callback(layer.register_forward_hook(after).remove)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
