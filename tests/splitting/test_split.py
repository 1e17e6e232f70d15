"""gpipe.split: any model cut into stages by tracing, exact against the model."""

import functools
import itertools

import pytest
import torch
from torch import nn

import gpipe
from gpipe import GPipe
from gpipe.planning.memory import plan, profile
from gpipe.splitting import CutError, SplitModel, TraceError

from .split_models import TinyLM, images, tiny_lm, tiny_resnet, token_batch

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_lm(split: SplitModel, model: nn.Module, batch: dict) -> None:
    model.zero_grad()
    split.zero_grad()
    want = model(**batch)
    got = split(batch)
    torch.testing.assert_close(got["logits"], want["logits"], **EXACT)
    torch.testing.assert_close(got["loss"], want["loss"], **EXACT)
    want["loss"].backward()
    got["loss"].backward()
    grads = _grads(model)
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, grads[split.original_name(name)], **EXACT)


@functools.cache
def _split_lm(at: tuple[str, ...]) -> tuple[nn.Module, SplitModel]:
    """A tiny LM and the split of it at ``at``, traced once for the module: each trace is a
    second of CPU, and the tests that take the split at ``blocks.2`` only run it, read its
    names, or compare its parameters with the model's by identity (none changes a weight)."""
    model = tiny_lm()
    return model, gpipe.split(model, (), token_batch(), at=list(at))


@pytest.mark.parametrize("at", [["blocks.2"], ["blocks.1", "blocks.3"], ["blocks.3", "norm"]])
def test_split_at_named_modules_runs_the_model_exactly(at):
    model = tiny_lm()  # the reference: the split model holds its own model's parameters
    _, split = _split_lm(tuple(at))
    assert len(split) == len(at) + 1 and split.at == at
    # other batch sizes and lengths, one row included, without tracing again
    for rows, length in [(6, 6), (3, 4), (1, 5), (2, 2)]:
        _check_lm(split, model, token_batch(rows, length, seed=rows))


def test_the_stages_hold_the_model_s_own_parameters():
    model, split = _split_lm(("blocks.2",))
    assert split[0].get_parameter("embed.weight") is model.embed.weight
    assert split[1].get_parameter("blocks.3.mix.bias") is model.blocks[3].mix.bias


def test_split_points_are_ordered_by_the_graph_not_by_the_caller():
    split = gpipe.split(tiny_lm(), (), token_batch(), at=["blocks.3", "blocks.1"])
    assert split.at == ["blocks.1", "blocks.3"]


def test_values_cross_cuts_as_payload_skip_or_size():
    split = gpipe.split(tiny_lm(), (), token_batch(), at=["blocks.1", "blocks.2", "blocks.3"])
    first, *middle, last = split.stages()
    # the mask is used by every block: it goes straight to each stage that uses it
    assert first.plan.stashes and all(s.plan.pops for s in [*middle[1:], last])
    # the batch size is used by every block's reshape: it rides in the payload
    kinds = first.plan.kinds
    assert any(kinds[key] == "int" for key in first.plan.sends)


def test_a_tied_weight_is_held_by_both_stages_and_named_once():
    model, split = _split_lm(("blocks.2",))
    assert split.split_names("head.weight") == ["0.embed.weight", "1.embed.weight"]
    assert split.split_names("embed.weight") == ["0.embed.weight", "1.embed.weight"]
    assert split.original_name("1.norm.bias") == "norm.bias"
    with pytest.raises(KeyError):
        split.original_name("1.blocks.0.mix.weight")  # stage 0 holds it
    state = split.original_state_dict()
    assert sorted(state) == sorted(model.state_dict())


def test_a_checkpoint_of_the_split_model_loads_into_the_model_and_back():
    source, target = tiny_lm(seed=1), tiny_lm(seed=2)
    split = gpipe.split(target, (), token_batch(), at=["blocks.2"])
    assert split.load_original_state_dict(source.state_dict()) == [0, 1]
    batch = token_batch()
    torch.testing.assert_close(split(batch)["logits"], source(**batch)["logits"], **EXACT)
    fresh = tiny_lm(seed=3)
    fresh.load_state_dict(split.original_state_dict())
    torch.testing.assert_close(fresh(**batch)["logits"], source(**batch)["logits"], **EXACT)


def test_a_residual_network_split_inside_its_residual_stages():
    model = tiny_resnet()
    x, _ = images()
    split = gpipe.split(model, (x,), at=["layer1.1", "layer2.0"])
    for rows in (6, 3, 1):
        torch.testing.assert_close(split(x[:rows]), model(x[:rows]), **EXACT)


def test_parts_cuts_between_blocks_where_parameters_are_most_even():
    """The most even of the cuts at two of the five places between blocks, counted from the
    model's own modules (rather than by splitting at each of the ten pairs: a trace each)."""
    model = tiny_resnet()
    x, _ = images()
    split = gpipe.split(model, (x,), parts=3)
    got = max(sum(p.numel() for p in stage.parameters()) for stage in split)
    # the modules in the order they run; the places to cut, 1 to 5, begin a stage at
    # pieces[1:]: layer1 (that is, layer1.0), layer1.1, layer2 (layer2.0), layer2.1, fc
    pieces = [model.stem, *model.layer1, *model.layer2, model.fc]
    counts = [sum(p.numel() for p in piece.parameters()) for piece in pieces]
    best = min(
        max(sum(counts[:i]), sum(counts[i:j]), sum(counts[j:]))
        for i, j in itertools.combinations(range(1, len(pieces)), 2)
    )
    assert got == best
    torch.testing.assert_close(split(x), model(x), **EXACT)


def test_parts_by_measured_time():
    model = tiny_lm()
    split = gpipe.split(tiny_lm(), (), token_batch(), parts=2, balance="time")
    assert len(split) == 2 and split.at[0] in {
        "embed",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "norm",
        "head",
        "blocks",
    }
    _check_lm(split, model, token_batch())


def test_gpipe_runs_a_split_model_with_its_tied_weight_summed():
    model = tiny_lm(return_dict=False)  # the stages hold the split model's own parameters
    batch = token_batch(7)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    split = gpipe.split(tiny_lm(return_dict=False), (ids, mask), at=["blocks.1", "blocks.3"])
    pipe = GPipe(split, [1, 1, 1], devices=["cpu"] * 3, chunks=3)
    out = pipe((ids, mask))
    want = model(ids, mask)
    torch.testing.assert_close(out, want, **EXACT)
    out.square().mean().backward()
    want.square().mean().backward()
    grads = _grads(model)
    for name, p in pipe.named_parameters():
        original = name.split(".", 3)[3]  # partitions.<p>.<layer>.<original name>
        torch.testing.assert_close(p.grad, grads[original], **EXACT)
    assert [t.stages for t in pipe.ties] == [(0, 2)]


def test_split_on_meta_then_loaded_from_a_state_dict():
    reference = tiny_lm()
    with torch.device("meta"):
        model = TinyLM().double()
    batch = token_batch()
    meta_batch = {k: v.to("meta") for k, v in batch.items()}
    split = gpipe.split(model, (), meta_batch, at=["blocks.2"])
    assert all(p.is_meta for p in split.parameters())
    split.to_empty(device="cpu")
    split.load_original_state_dict(reference.state_dict())
    _check_lm(split, reference, batch)


class CountsPerExpert(nn.Module):
    """Routes each row to an expert and scales it by how many rows its expert took, counted
    as Hugging Face's mixtures of experts count them: ``histc`` of integers except on a CPU
    (or Apple's GPU), whose kernel takes floats only."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router, self.out = nn.Linear(3, experts), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).argmax(-1)
        on_cpu = chosen.device.type in ("cpu", "mps")
        counts = torch.histc(chosen.float() if on_cpu else chosen.int(), bins=4, min=0, max=3)
        return self.out(x) * counts.to(x.dtype)[chosen, None]


def test_a_model_split_on_meta_counts_as_it_does_on_the_cpu_it_runs_on():
    """Traced on meta, the model took the integer branch; the stage still runs on the CPU."""
    torch.manual_seed(0)
    reference = nn.Sequential(CountsPerExpert(), CountsPerExpert()).double()
    with torch.device("meta"):
        model = nn.Sequential(CountsPerExpert(), CountsPerExpert()).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    split = gpipe.split(model, (x.to("meta"),), parts=2)
    split.to_empty(device="cpu")
    split.load_original_state_dict(reference.state_dict())
    torch.testing.assert_close(split(x), reference(x), **EXACT)


class Scaled(nn.Module):
    """A map whose output is scaled by a buffer no state dict holds, as a rotary
    embedding's frequencies are held (and moved to its input's device, as they are)."""

    def __init__(self) -> None:
        super().__init__()
        self.map = nn.Linear(3, 3)
        self.register_buffer("scale", torch.arange(1.0, 4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.map(x) * self.scale.to(x.device)


def _parameters_to_meta(model: nn.Module) -> nn.Module:
    """Every parameter on the meta device, buffers left where they are: ``Module.to`` would
    move both, so the parameters are replaced in torch's own registry."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            module._parameters[name] = nn.Parameter(param.to("meta"))
    return model


def test_buffers_no_state_dict_holds_are_put_back_from_the_model_that_was_split():
    """Built with its parameters alone on meta, the model's unsaved buffers are real when it
    is split, and loading the stages puts them back after allocation; built wholly on meta,
    they are refused unless the state dict gives them."""
    torch.manual_seed(0)
    reference = nn.Sequential(Scaled(), Scaled())
    x = torch.randn(4, 3)
    model = _parameters_to_meta(nn.Sequential(Scaled(), Scaled()))
    split = gpipe.split(model, (x.to("meta"),), parts=2)
    split.to_empty(device="cpu")  # what a Pipeline does to a stage on meta
    split.load_original_state_dict(reference.state_dict())
    torch.testing.assert_close(split(x), reference(x))
    with torch.device("meta"):
        model = nn.Sequential(Scaled(), Scaled())
    split = gpipe.split(model, (x.to("meta"),), parts=2)
    split.to_empty(device="cpu")
    with pytest.raises(ValueError, match="stage 0's buffer 0.scale is in no state dict and was"):
        split.load_original_state_dict(reference.state_dict())
    split.load_original_state_dict({**reference.state_dict(), **dict(reference.named_buffers())})
    torch.testing.assert_close(split(x), reference(x))


def test_the_memory_planner_works_on_a_split_model_on_meta():
    with torch.device("meta"):
        model = TinyLM(n_blocks=6).double()
    batch = {k: v.to("meta") for k, v in token_batch(8).items()}
    split = gpipe.split(model, (), batch, parts=3)
    measured = profile(split, batch)
    assert len(measured) == 3 and all(n > 0 for n in measured.params)
    assert all(measured.held(start, start + 1, 4)[0] > 0 for start in range(3))
    memory = plan(measured, [1, 1, 1], batch_size=16, chunks=4, schedule="1f1b")
    assert len(memory.ranks) == 3 and all(r.activation_bytes > 0 for r in memory.ranks)


# -- bad input ----------------------------------------------------------------------------


def test_a_split_point_that_is_not_a_submodule_names_the_nearest():
    with pytest.raises(
        CutError, match=r"'block\.2' is not a submodule of TinyLM; nearest: blocks\.2"
    ):
        gpipe.split(tiny_lm(), (), token_batch(), at=["block.2"])


def test_split_points_that_cannot_begin_a_stage():
    batch = token_batch()
    x, _ = images()
    with pytest.raises(CutError, match="'stem' is where TinyResNet.forward begins"):
        gpipe.split(tiny_resnet(), (x,), at=["stem"])
    with pytest.raises(CutError, match="'blocks.2' and 'blocks.2.norm' begin at the same node"):
        gpipe.split(tiny_lm(), (), batch, at=["blocks.2", "blocks.2.norm"])
    model = tiny_lm()
    model.unused = nn.Linear(2, 2)
    with pytest.raises(CutError, match="'unused' never runs in TinyLM.forward"):
        gpipe.split(model, (), batch, at=["unused"])


def test_too_many_parts_says_how_many_there_can_be():
    expected = r"parts=9 but TinyLM has 7 places to cut .* at most 8 parts"
    with pytest.raises(CutError, match=expected):
        gpipe.split(tiny_lm(), (), token_batch(), parts=9)


def test_bad_arguments_are_named():
    batch = token_batch()
    with pytest.raises(ValueError, match="either at=.* or parts=K"):
        gpipe.split(tiny_lm(), (), batch)
    with pytest.raises(ValueError, match="parts must be a positive integer, got 0"):
        gpipe.split(tiny_lm(), (), batch, parts=0)
    with pytest.raises(ValueError, match="balance must be one of"):
        gpipe.split(tiny_lm(), (), batch, parts=2, balance="flops")
    with pytest.raises(TypeError, match="at must be a list of submodule names"):
        gpipe.split(tiny_lm(), (), batch, at="blocks.2")
    with pytest.raises(ValueError, match=r"example_kwargs\['input_ids'\] has 1 row"):
        gpipe.split(tiny_lm(), (), token_batch(1), at=["blocks.2"])


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.b(self.a(x))
        return self.a(x)


def test_a_model_export_cannot_trace_gets_one_line_of_reason_and_advice():
    with pytest.raises(TraceError) as info:
        gpipe.split(DataDependent(), torch.randn(4, 3), at=["b"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("torch.export could not trace DataDependent:")
    assert "test_split.py" in message and "if x.sum() > 0:" in message
    assert "torch.cond" in message
    assert info.value.export_error is not None


class Blocks(nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3), middle, nn.Linear(3, 3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Repeats(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x):
        for _ in range(int(x.abs().sum()) % 3):  # a count read from the values
            x = self.a(x)
        return x


@pytest.mark.parametrize("middle", [DataDependent, Repeats])
def test_a_layer_export_cannot_trace_is_named_by_its_place_in_the_model(middle):
    with pytest.raises(TraceError) as info:
        gpipe.split(Blocks(middle()), torch.randn(4, 3), parts=2)
    message = str(info.value)
    assert "\n" not in message
    name = middle.__name__
    assert message.startswith(
        f"torch.export could not trace Blocks in its layer blocks.1 ({name}):"
    )


class OneRowBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        x = self.a(x)
        if x.size(0) == 1:
            x = x * 2
        return self.b(x)


def test_a_model_that_branches_on_one_row_is_caught():
    with pytest.raises(ValueError, match="computes something else for a 1-row input"):
        gpipe.split(OneRowBranch(), torch.randn(4, 3), at=["b"])
    split = gpipe.split(OneRowBranch(), torch.randn(4, 3), at=["b"], check=False)
    assert len(split) == 2


def test_inputs_that_do_not_fit_the_trace_are_named():
    _, split = _split_lm(("blocks.2",))
    with pytest.raises(TypeError, match="input does not match the examples"):
        split({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match="takes a tensor, a tuple .* or a dict"):
        split("text")


class Regularized(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.drop, self.b = nn.Dropout(0.5), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.drop(self.norm(self.a(x))))


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_train_and_eval_follow_the_stage_s_mode_whatever_it_was_traced_in(traced_in):
    torch.manual_seed(0)
    model, x = Regularized().double(), torch.randn(8, 4, dtype=torch.float64)
    twin = Regularized().double()
    twin.load_state_dict(model.state_dict())
    getattr(twin, traced_in)()
    split = gpipe.split(twin, (x,), at=["b"], check=False)
    for mode in ("train", "eval", "train"):
        getattr(model, mode)()
        getattr(split, mode)()
        torch.manual_seed(1)
        want = model(x)
        torch.manual_seed(1)
        torch.testing.assert_close(split(x), want, **EXACT)  # same dropout, same statistics
    torch.testing.assert_close(split[0].get_buffer("norm.running_mean"), model.norm.running_mean)
    # traced in eval, the graph never counts batches: the count is held, but stays
    count = split[0].get_buffer("norm.num_batches_tracked")
    assert count == (model.norm.num_batches_tracked if traced_in == "train" else 0)
    assert sorted(split.original_state_dict()) == sorted(model.state_dict())
