"""What the processes of tests/runtime/test_compiled.py run (importable by name)."""

import warnings

import torch
from torch import nn
from torch.nn.functional import mse_loss

from gpipe import Pipeline
from gpipe.runtime.recompute import Layers

from ..small_models import batch, mlp

# AOTAutograd without code generation: the same graphs, forward and backward, that
# torch.compile's default backend compiles, in a fraction of its time on CPU
AOT_EAGER = {"backend": "aot_eager"}
EXACT = {"rtol": 1e-12, "atol": 1e-14}


class Probe(nn.Module):
    """The identity, counting the calls that ran compiled code."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # replayed after each call of the compiled graph
            self.compiled_calls += 1
        return x


def probed_mlp() -> nn.Sequential:
    """small_models.mlp with a Probe after it (nine layers)."""
    return nn.Sequential(*mlp(), Probe())


# These processes are shared by the module's tests, and every earlier test's layers, shapes
# and grad modes count toward torch.compile's limit of recompilations per function: past it,
# a layer would quietly run eager. A higher limit for these cases keeps what earlier ones
# compiled, where a reset before each split-backward case compiled every layer again (half
# of the module's CPU time).
@torch._dynamo.config.patch(recompile_limit=64)
def compiled_against_eager(schedule: str, balance: list[int], checkpoint: str) -> dict:
    """Two steps with an optimizer step between, compiled and eager on the same data (10 rows
    in 4 micro-batches: one short): losses, gradients and outputs equal, and equal to
    un-pipelined training. Returns what the compiled pipeline warned and whether its layers'
    forwards are compiled functions, and how often the compiled pipeline's Probe ran
    compiled (the eager one's never did)."""
    mode = Layers(every=2) if checkpoint == "layers" else checkpoint
    pipes = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for compiled in (False, True):
            pipes[compiled] = Pipeline(
                probed_mlp(),
                balance,
                chunks=4,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=mse_loss,
                compile=AOT_EAGER if compiled else False,
            )
    reference = probed_mlp()
    optimizers = {c: torch.optim.SGD(p.parameters(), lr=0.1) for c, p in pipes.items()}
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(10, seed=step)
        ref_optimizer.zero_grad()
        ref_loss = mse_loss(reference(x), y)
        ref_loss.backward()
        ref = dict(reference.named_parameters())
        for compiled, pipe in pipes.items():
            optimizers[compiled].zero_grad()
            loss = pipe.step(x, y)
            torch.testing.assert_close(loss, ref_loss.detach(), **EXACT)
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad, ref[name].grad, **EXACT)
            optimizers[compiled].step()
        ref_optimizer.step()
    in_training = _probe_calls(pipes)
    for pipe in pipes.values():
        out = pipe(x)
        if pipe.is_last:
            torch.testing.assert_close(out, reference(x), **EXACT)
    layers = [layer for stage in pipes[True].runner.stages.values() for layer in stage.module]
    return {
        "probe_compiled_calls": _probe_calls(pipes),
        "probe_compiled_calls_in_training": in_training,
        "warned": [str(w.message) for w in caught if "compile=True" in str(w.message)],
        "compiled": all("forward" in vars(layer) for layer in layers),
        "eager_untouched": not any(
            "forward" in vars(layer)
            for stage in pipes[False].runner.stages.values()
            for layer in stage.module
        ),
    }


def _probe_calls(pipes: dict[bool, Pipeline]) -> dict[bool, int]:
    """How often each pipeline's Probe has run compiled code so far."""
    return {
        compiled: sum(
            layer.compiled_calls
            for stage in pipe.runner.stages.values()
            for layer in stage.module
            if isinstance(layer, Probe)
        )
        for compiled, pipe in pipes.items()
    }
