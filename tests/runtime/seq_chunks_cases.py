"""What the processes of tests/runtime/test_seq_chunks.py run (importable by name)."""

import copy
import warnings

import torch
from torch import nn

from gpipe import Pipeline
from gpipe.models.gpt import Block, GPTConfig, build_gpt, lm_loss
from gpipe.parallel.sharding import Sharding

EXACT = {"rtol": 1e-10, "atol": 1e-12}


def _gpt() -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=3, d_model=32, n_head=4, seq_len=24, vocab_size=64)
    model = build_gpt(config).double()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 7, 24), generator=generator)  # 7 rows: uneven micro-batches
    return model, x, y


# the GPT's 5 layers; [4, 1]: a last stage without attention; on a V of 4 stages, rank 0
# holds the embedding and the head, rank 1 the blocks
_BALANCES = {
    (False, "even"): [2, 3],
    (False, "balanced"): [4, 1],
    (True, "even"): [1, 2, 1, 1],
    (True, "balanced"): [1, 1, 2, 1],
}


def gpt_against_unsplit(schedule: str, checkpoint: str, seq_chunks: int, split: str) -> int:
    """Two SGD steps of the GPT with sequence-pipelined micro-batches, in float64: the loss,
    every gradient and the updated weights equal those of un-pipelined training on the whole
    batch. Returns the number of steps compared."""
    reference, x, y = _gpt()
    pipe = Pipeline(
        copy.deepcopy(reference),
        _BALANCES[schedule == "zero-bubble-v", split],
        chunks=3,
        schedule=schedule,
        checkpoint=checkpoint,
        loss_fn=lm_loss,
        seq_chunks=seq_chunks,
        seq_split=split,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        length = 24 - 4 * step  # a second sequence length too
        inputs, targets = x[:, :length], y[:, :length]
        reference.zero_grad()
        expected = lm_loss(reference(inputs), targets)
        expected.backward()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        pipe.zero_grad()
        calls = _counting_cached_calls(pipe)
        loss, outputs, _ = pipe.step(inputs, targets, return_outputs=True)
        assert calls == [3 * seq_chunks * (2 if checkpoint == "always" else 1)], calls
        torch.testing.assert_close(loss, expected.detach(), **EXACT)
        if pipe.is_last:  # the sub-sequences' logits, joined
            torch.testing.assert_close(outputs, reference(inputs), **EXACT)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], **EXACT, msg=name)
        optimizer.step()
        ref_optimizer.step()
    return 2


def _counting_cached_calls(pipe: Pipeline) -> list[int]:
    """A list whose one entry counts the cached forwards of this rank's first layer: one
    per sub-sequence, and one more per recomputation."""
    calls = [0]
    stage = pipe.runner.stages[pipe.stage_index]
    layer = next(iter(stage.module.children()))
    cached = layer.forward_cached

    def counted(*args, **kwargs):
        calls[0] += 1
        return cached(*args, **kwargs)

    layer.forward_cached = counted
    return calls


class CachedProbe(nn.Module):
    """The identity, also as a cached layer, counting the sub-sequences that ran it compiled."""

    def __init__(self) -> None:
        super().__init__()
        # a tensor, counted inside the compiled graph: an int attribute would be a constant
        # of the graph, compiled again at every count
        self.register_buffer("compiled_calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def new_cache(self) -> None:
        return None

    def forward_cached(self, x: torch.Tensor, cache: None, context: object) -> torch.Tensor:
        if torch.compiler.is_compiling():
            self.compiled_calls.add_(1)
        return x


def compiled_against_eager(schedule: str) -> dict:
    """The GPT with a CachedProbe among its blocks on three sub-sequences per micro-batch,
    compiled (``aot_eager``: the graphs torch.compile's default backend would compile) and
    eager, never and always re-materialized: two SGD steps each, whose losses and gradients
    equal un-pipelined training's in float64. Returns, per mode, how many sub-sequences ran
    the probe compiled, and what the compiled pipeline warned.

    The micro-batches are even and both steps have the same length: each new shape would
    compile every layer again (the short micro-batch and the second length took this case
    from 16 s to 26 s alone on two cores), and what shapes do to the sub-sequences is what
    the eager cases above check."""
    torch.compiler.reset()  # these processes are shared: start below the recompilation limit
    model, x, y = _gpt()
    x, y = x[:6], y[:6]  # three micro-batches of two rows
    layers = list(model)
    model = nn.Sequential(*layers[:2], CachedProbe(), *layers[2:])
    found = {}
    for checkpoint in ("never", "always"):
        reference = copy.deepcopy(model)
        pipes = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for compiled in (False, True):
                pipes[compiled] = Pipeline(
                    copy.deepcopy(model),
                    [3, 3],
                    chunks=3,
                    schedule=schedule,
                    checkpoint=checkpoint,
                    loss_fn=lm_loss,
                    seq_chunks=3,
                    compile={"backend": "aot_eager"} if compiled else False,
                )
        optimizers = {c: torch.optim.SGD(p.parameters(), lr=0.5) for c, p in pipes.items()}
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        for _ in range(2):
            ref_optimizer.zero_grad()
            expected = lm_loss(reference(x), y)
            expected.backward()
            grads = dict(reference.named_parameters())
            for compiled, pipe in pipes.items():
                optimizers[compiled].zero_grad()
                loss = pipe.step(x, y)
                torch.testing.assert_close(loss, expected.detach(), **EXACT)
                for name, p in pipe.named_parameters():
                    torch.testing.assert_close(p.grad, grads[name].grad, **EXACT, msg=name)
                optimizers[compiled].step()
            ref_optimizer.step()
        probes = [
            layer
            for stage in pipes[True].runner.stages.values()
            for layer in stage.module
            if isinstance(layer, CachedProbe)
        ]
        found[checkpoint] = {
            "probe_compiled_calls": sum(int(probe.compiled_calls) for probe in probes),
            "warned": [str(w.message) for w in caught if "compile=True" in str(w.message)],
        }
    return found


def _logits_loss(out, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return lm_loss(logits, targets)


def hf_against_unsplit(schedule: str, checkpoint: str, kind: str = "llama") -> int:
    """A Hugging Face model cut by its plan, on four sub-sequences per micro-batch: the loss
    and every gradient of one step equal the unsplit model's in float64. ``"llama"``: its
    rotary positions, grouped keys and values and its own cache class; ``"gpt2"``: a layout
    read from its modules, with learned positions that every stage's code adds."""
    import gpipe

    from ..splitting.hf_cases import gpt2_model, llama_model

    reference = llama_model() if kind == "llama" else gpt2_model()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (5, 21), generator=generator)
    x, y = ids[:, :-1], ids[:, 1:]
    parts = 4 if schedule == "zero-bubble-v" else 2  # a V: two stages a process
    split = gpipe.split(copy.deepcopy(reference), parts=parts, plan="hf")
    pipe = Pipeline(
        split,
        chunks=2,
        schedule=schedule,
        checkpoint=checkpoint,
        loss_fn=_logits_loss,
        seq_chunks=4,
    )
    expected = _logits_loss(reference(x), y)
    expected.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    calls = _counting_cached_calls(pipe)
    loss = pipe.step(x, y)
    assert calls == [2 * 4 * (2 if checkpoint == "always" else 1)], calls
    torch.testing.assert_close(loss, expected.detach(), **EXACT)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[split.original_name(name)], **EXACT, msg=name)
    return 1


def padded_targets(schedule: str) -> int:
    """Right-padded targets (-100, which the loss ignores) in uneven micro-batches, weighed
    by their counted tokens (``counts=targets != -100``): the loss and gradients of the
    unsplit step, float64, though some sub-sequences hold padding only (their weight is 0,
    and a mean over their tokens would be NaN). Returns the number of steps compared."""
    reference, x, y = _gpt()
    y = y.clone()
    y[:, 14:] = -100  # every row: the last of four sub-sequences of 6 tokens is padding
    y[0, 3:] = -100  # one row: from its first sub-sequence on
    y[4, 9:] = -100
    balance = _BALANCES[schedule == "zero-bubble-v", "even"]
    options = {"chunks": 3, "schedule": schedule, "loss_fn": lm_loss, "seq_chunks": 4}
    pipe = Pipeline(copy.deepcopy(reference), balance, **options)
    _same_step(pipe, reference, x, y, lm_loss, str, counts=y != -100)
    return 1


def refusal(case: str) -> str:
    """One step with bad input (``case``), on a pipeline of its own: what this rank raised."""
    model, x, y = _gpt()
    pipe = Pipeline(model, [2, 3], chunks=2, loss_fn=lm_loss, seq_chunks=4, timeout=20)
    packed = {"input_ids": x, "position_ids": torch.arange(24).expand(7, 24)}
    inputs, targets = {
        "uneven": (x[:, :22], y[:, :22]),
        "no targets": (x, None),
        "packed": (packed, y),
        "row counts": (x, y),
    }[case]
    counts = torch.ones(7) if case == "row counts" else None
    try:
        pipe.step(inputs, targets, counts=counts)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def with_replicas() -> float:
    """Two replicas of a two-stage 1F1B pipeline on three sub-sequences per micro-batch, each
    on its half of the batch: the loss and every gradient of one unsplit step on the whole
    batch, float64. Returns the largest gradient difference."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=24, vocab_size=64)
    reference = build_gpt(config).double()
    pipe = Pipeline(
        copy.deepcopy(reference),
        [2, 2],
        chunks=2,
        schedule="1f1b",
        loss_fn=lm_loss,
        seq_chunks=3,
        data_parallel=2,
    )
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 8, 24), generator=generator)
    assert pipe.replicas is not None
    half = pipe.replicas.replica
    loss = pipe.step(x.chunk(2)[half], y.chunk(2)[half])
    expected = lm_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **EXACT)
    grads = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, **EXACT, msg=name)
    return max(float((p.grad - grads[n].grad).abs().max()) for n, p in pipe.named_parameters())


# each schedule once, and each mode: what sharding adds is the gathering of the parameters
# for every sub-sequence's forward and recomputation, whatever the order
SHARDED_SETTINGS = (("gpipe", "always"), ("1f1b", "never"), ("zero-bubble", "always"))


def with_sharded_replicas() -> list[str]:
    """Two replicas of a two-stage pipeline sharded over each other (``shard="full"``, 4
    processes) on sub-sequences, each on its half of the batch: the GPT under
    ``SHARDED_SETTINGS`` for two SGD steps, and a Hugging Face Llama under 1F1B: the loss,
    every gathered gradient and the updated weights equal those of unsplit training on the
    whole batch in float64. Returns the settings compared, then what a stage whose embedding
    is outside every unit is refused with."""
    compared = []
    model, x, y = _gpt()
    x, y = x[:6], y[:6]  # 3 rows a replica
    for schedule, checkpoint in SHARDED_SETTINGS:
        reference = copy.deepcopy(model)
        pipe = Pipeline(
            copy.deepcopy(model),
            [2, 3],
            chunks=3,
            schedule=schedule,
            checkpoint=checkpoint,
            loss_fn=lm_loss,
            seq_chunks=3,
            data_parallel=2,
            shard="full",
        )
        assert pipe.replicas is not None
        half = pipe.replicas.replica
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        for step in range(2):
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
            length = 24 - 6 * step  # a second sequence length too
            xs, ys = x[:, :length], y[:, :length]
            _same_step(
                pipe,
                reference,
                (xs.chunk(2)[half], xs),
                (ys.chunk(2)[half], ys),
                lm_loss,
                lambda name: name,
            )
            optimizer.step()
            ref_optimizer.step()
        weights = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.full_tensor(), weights[name], **EXACT, msg=name)
        compared.append(f"gpt {schedule} {checkpoint}")
    _llama_step(schedule="1f1b", data_parallel=2, shard="full")
    compared.append("llama 1f1b")
    # units of blocks alone leave the embedding to the stage's own unit, which sub-sequences
    # never gather: every rank refuses, naming the layer and the stage
    try:
        Pipeline(
            copy.deepcopy(model),
            [2, 3],
            chunks=3,
            loss_fn=lm_loss,
            seq_chunks=3,
            data_parallel=2,
            shard=Sharding(unit=(Block,)),
        )
    except ValueError as exc:
        return [*compared, str(exc)]
    return compared


def with_tensor_parallel() -> list[str]:
    """Two tensor ranks per stage (4 processes), their layers split by the model's own plan,
    on sub-sequences: the GPT under 1F1B (S = 3) and under zero-bubble re-materialized with
    its logits split by vocabulary (S = 4, ``loss_parallel``), and a Hugging Face Llama under
    gpipe (S = 4): the loss and every gathered gradient of one step equal the unsplit
    model's in float64. Returns the settings compared."""
    compared = []
    model, x, y = _gpt()
    # three micro-batches of two rows: each shape costs DTensor's sharding propagation anew,
    # and what uneven micro-batches do to sub-sequences is what the eager cases check
    x, y = x[:6], y[:6]
    for schedule, chunks, options in (
        ("1f1b", 3, {}),
        ("zero-bubble", 4, {"checkpoint": "always", "loss_parallel": True}),
    ):
        reference = copy.deepcopy(model)
        pipe = Pipeline(
            copy.deepcopy(model),
            [2, 3],
            chunks=3,
            schedule=schedule,
            loss_fn=lm_loss,
            seq_chunks=chunks,
            tensor_parallel=2,
            **options,
        )
        _same_step(pipe, reference, x, y, lm_loss, lambda name: name)
        compared.append(f"gpt {schedule} S={chunks}")
    _llama_step(tensor_parallel=2)
    return [*compared, "llama gpipe S=4"]


def _llama_step(**options) -> None:
    """A Hugging Face Llama cut by its plan, four sub-sequences per micro-batch, ``options``
    given to ``Pipeline``: one step equals the unsplit model's on the whole batch (each
    replica, if there are several, given its half)."""
    import gpipe

    from ..splitting.hf_cases import llama_model

    reference = llama_model()
    ids = torch.randint(1, 64, (4, 17), generator=torch.Generator().manual_seed(2))
    split = gpipe.split(copy.deepcopy(reference), parts=2, plan="hf")
    pipe = Pipeline(split, chunks=2, loss_fn=_logits_loss, seq_chunks=4, **options)
    x, y = ids[:, :-1], ids[:, 1:]
    if pipe.replicas is not None:
        half = pipe.replicas.replica
        x, y = (x.chunk(2)[half], x), (y.chunk(2)[half], y)
    _same_step(pipe, reference, x, y, _logits_loss, split.original_name)


def _same_step(pipe, reference, x, y, loss_fn, original_name, **options) -> None:
    """One step of ``pipe`` (given ``options``) against one of ``reference`` on the whole
    batch: the same loss and, gathered from the tensor ranks or replicas, the same gradients.
    ``x`` and ``y`` may be pairs: this replica's share, then the whole batch."""
    mine, x = x if isinstance(x, tuple) else (x, x)
    theirs, y = y if isinstance(y, tuple) else (y, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    loss = pipe.step(mine, theirs, **options)
    torch.testing.assert_close(loss, expected.detach(), **EXACT)
    for name, p in pipe.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, grads[original_name(name)], **EXACT, msg=name)
