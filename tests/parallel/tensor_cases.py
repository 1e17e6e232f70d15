"""What each process runs in tests/parallel/test_tensor.py: Pipeline(tensor_parallel=2) over
real processes, against the unsplit model's steps on the same rows, in float64."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gpipe import Pipeline
from gpipe.models.gpt import GPTConfig, build_gpt, generate, lm_loss
from gpipe.parallel.replicas import shard as replica_rows
from gpipe.schedules import SCHEDULES, traits

EXACT = {"rtol": 1e-12, "atol": 1e-14}
GRADIENTS = {"rtol": 1e-10, "atol": 1e-14}  # summed in another order across the tensor ranks
T = 2
CONFIG = GPTConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, tied=False)
# for AdamW's steps: a key's bias gets no gradient but rounding, which Adam would enlarge
BIASLESS = GPTConfig(
    n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, tied=False, bias=False
)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a split one (gathered over the ranks that hold its shards)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gpt(tied: bool = True, config: GPTConfig = CONFIG) -> nn.Sequential:
    """A tiny float64 GPT, the same on every rank; tied: the embedding and head share one
    Parameter (a tie across stages)."""
    torch.manual_seed(0)
    model = build_gpt(config).double()
    if tied:
        model[-1].proj.weight = model[0].token.weight
    return model


def tokens(rows: int, seed: int, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CONFIG.vocab_size, (rows, length), generator=g)
    return x, torch.randint(0, CONFIG.vocab_size, (rows, length), generator=g)


def _balance(schedule: str) -> list[int]:
    return [1, 1, 1, 1] if traits(schedule).several_stages_per_rank else [2, 2]


def _rows(t: torch.Tensor, pipe: Pipeline) -> torch.Tensor:
    """This pipeline's rows of a global mini-batch: its replica's shard."""
    if pipe.replicas is None:
        return t
    return replica_rows(t, pipe.replicas.replica, pipe.replicas.data_parallel)


def _ends(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple:
    return (_rows(x, pipe) if pipe.is_first else None, _rows(y, pipe) if pipe.is_last else None)


def _step_as_unsplit(pipe, reference, x, y):
    """A step of ``pipe`` on ``x`` against ``y``: the loss and every gathered gradient those
    of ``reference``'s backward; returns what ``_check_gradients`` does."""
    loss = pipe.step(*_ends(pipe, x, y))
    expected = lm_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **EXACT)
    return _check_gradients(pipe, reference)


def _check_gradients(pipe: Pipeline, reference: nn.Module) -> int:
    """Every gathered gradient equals the reference's; returns how many are split."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    split = 0
    for name, p in pipe.named_parameters():
        split += isinstance(p.grad, DTensor)
        torch.testing.assert_close(
            full(p.grad), ref[name].grad, **GRADIENTS, msg=lambda m, name=name: f"{name}: {m}"
        )
    return split


def exactness(schedules=tuple(SCHEDULES), modes=("never", "always"), **more) -> dict:
    """Every schedule x checkpoint mode at T = 2 (and D replicas, sharded or not, with
    ``more``): the loss, every gathered gradient and the gradient norm equal one step of the
    unsplit model on the whole mini-batch; after two AdamW steps every weight equals its
    within 1e-12. Two steps are enough: the second runs on weights the first step's update
    wrote into the split parameters, with the optimizer state that update left; a third
    would repeat it."""
    cases, split = 0, 0
    for schedule in schedules:
        for mode in modes:
            pipe = Pipeline(
                gpt(config=BIASLESS),
                _balance(schedule),
                chunks=4,
                checkpoint=mode,
                schedule=schedule,
                loss_fn=lm_loss,
                tensor_parallel=T,
                timeout=30,
                **more,
            )
            reference = gpt(config=BIASLESS)
            optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pipe, reference)]
            for step in range(2):
                x, y = tokens(8, seed=step)
                for optimizer in optimizers:
                    optimizer.zero_grad()
                split = _step_as_unsplit(pipe, reference, x, y)
                norm = pipe.clip_grad_norm_(1e9)
                want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
                torch.testing.assert_close(norm.double(), want.double(), **GRADIENTS)
                for optimizer in optimizers:
                    optimizer.step()
            ref = dict(reference.named_parameters(remove_duplicate=False))
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(
                    full(p.detach()), ref[name].detach(), rtol=1e-12, atol=1e-14, msg=name
                )
            cases += 1
    return {"cases": cases, "split": split, "rank": dist.get_rank()}


def compositions() -> dict:
    """Uneven and pre-split micro-batches, evaluation, forward-only log-probabilities and
    clipping at T = 2 x K = 2, each against the unsplit model."""
    done = {}
    pipe = Pipeline(gpt(), [2, 2], chunks=3, loss_fn=lm_loss, tensor_parallel=T, timeout=30)
    reference = gpt()
    # 7 rows in 3 micro-batches of 3, 2 and 2
    x, y = tokens(7, seed=3)
    _step_as_unsplit(pipe, reference, x, y)
    done["uneven"] = True
    # micro-batches of their own rows and lengths, given on every rank
    pipe.zero_grad()
    reference.zero_grad()
    given = [tokens(3, seed=4, length=16), tokens(5, seed=5, length=12)]
    loss = pipe.step(microbatches=given)
    rows = sum(x.shape[0] for x, _ in given)
    expected = sum(lm_loss(reference(x), y) * x.shape[0] / rows for x, y in given)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **EXACT)
    _check_gradients(pipe, reference)
    done["presplit"] = True
    # the loss alone, and the log-probabilities of the targets
    x, y = tokens(6, seed=6)
    with torch.no_grad():
        logits = reference(x)
    torch.testing.assert_close(pipe.evaluate(*_ends(pipe, x, y)), lm_loss(logits, y), **EXACT)
    logprobs = pipe.forward_only(*_ends(pipe, x, y))
    if pipe.is_last:
        want = torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logprobs, want, **GRADIENTS)
    done["forward_only"] = True
    # micro-batches cut along their sequence, the later sub-sequences attending to the
    # earlier ones' keys and values, which are split by heads
    pipe = Pipeline(
        gpt(), [2, 2], chunks=2, loss_fn=lm_loss, tensor_parallel=T, seq_chunks=2, timeout=30
    )
    reference = gpt()
    _step_as_unsplit(pipe, reference, x, y)
    done["seq_chunks"] = True
    return done


def mixed_precision() -> float:
    """bfloat16 autocast and a GradScaler at T = 2: the step's loss and the gradients after
    unscaling and clipping stay near the float32 unsplit model's under the same autocast,
    and every rank steps."""
    config = CONFIG
    torch.manual_seed(0)
    model = build_gpt(config)
    reference = copy.deepcopy(model)
    pipe = Pipeline(
        model,
        [2, 2],
        chunks=2,
        loss_fn=lm_loss,
        tensor_parallel=T,
        autocast=torch.bfloat16,
        timeout=30,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = tokens(4, seed=7)
    loss = pipe.step(*_ends(pipe, x, y), scaler=scaler)
    skipped = pipe.unscale_(scaler, optimizer)
    pipe.clip_grad_norm_(1.0)
    scaler.step(optimizer)
    scaler.update()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = lm_loss(reference(x), y)
    assert not skipped
    return float((loss.detach() - expected.float()).abs())


def batch_norm() -> bool:
    """DeferredBatchNorm between split layers: each micro-batch normalized by its own
    statistics, as the unsplit model run micro-batch by micro-batch, and the running
    statistics the whole mini-batch's, as the unsplit model counts them in one pass."""
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
    ).double()
    per_microbatch, whole = copy.deepcopy(layers), copy.deepcopy(layers)
    plan = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}
    pipe = Pipeline(
        layers,
        [4, 3],
        chunks=4,
        loss_fn=nn.functional.mse_loss,
        tensor_parallel=T,
        tp_plan=plan,
        deferred_batch_norm=True,
        timeout=30,
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 8, generator=g).double(), torch.randn(12, 4, generator=g).double()
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    mse = nn.functional.mse_loss
    pairs = zip(x.chunk(4), y.chunk(4), strict=True)
    expected = sum(mse(per_microbatch(a), b) for a, b in pairs) / 4
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **EXACT)
    _check_gradients(pipe, per_microbatch)
    with torch.no_grad():
        whole(x)
    if pipe.is_first:
        norm, want = pipe.get_submodule("3"), whole[3]
        torch.testing.assert_close(norm.running_mean, want.running_mean, **EXACT)
        torch.testing.assert_close(norm.running_var, want.running_var, **EXACT)
    return True


def generation() -> list[list[int]]:
    """Greedy tokens at T = 2 x K = 2 equal the unsplit GPT's own sampler's."""
    config = GPTConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=40)
    torch.manual_seed(0)
    model = build_gpt(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)  # wide weights: greedy tokens vary from step to step
    reference = copy.deepcopy(model).eval()
    pipe = Pipeline(model, [2, 2], tensor_parallel=T, timeout=30)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 9, 5)]
    got = pipe.generate(prompts, 8)
    for ids, new in zip(prompts, got, strict=True):
        want = generate(reference, torch.tensor([ids]), 8, config.seq_len, top_k=1)
        assert new == want[0, len(ids) :].tolist(), (new, want)
    return got


def _shared_within_a_stage() -> nn.Sequential:
    layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    layers[1].weight = layers[0].weight
    return layers


def bad_inputs() -> dict:
    """Each refusal, one line, on every rank alike."""
    found = {}
    attempts = {
        "heads": lambda: Pipeline(
            gpt(config=GPTConfig(n_layer=2, d_model=32, n_head=2, vocab_size=64, tied=False)),
            [2, 2],
            tensor_parallel=4,
            loss_fn=lm_loss,
        ),
        "vocabulary": lambda: Pipeline(
            gpt(config=GPTConfig(n_layer=2, d_model=32, n_head=4, vocab_size=63, tied=False)),
            [2, 2],
            tensor_parallel=2,
            loss_fn=lm_loss,
        ),
        "world": lambda: Pipeline(
            gpt(config=GPTConfig(n_layer=2, d_model=48, n_head=6, vocab_size=66, tied=False)),
            [2, 2],
            tensor_parallel=3,
            loss_fn=lm_loss,
        ),
        "no module": lambda: Pipeline(
            gpt(), [2, 2], tensor_parallel=2, tp_plan={"9.mlp.fc": "colwise"}
        ),
        "style": lambda: Pipeline(
            gpt(), [2, 2], tensor_parallel=2, tp_plan={"1.mlp.fc": "diagonal"}
        ),
        "size": lambda: Pipeline(gpt(), [2, 2], tensor_parallel=0),
        "loss parallel alone": lambda: Pipeline(gpt(), [2, 2], loss_parallel=True),
        "tie split unlike": lambda: Pipeline(
            gpt(), [2, 2], tensor_parallel=2, tp_plan={"0.token": "rowwise", "*.mlp.fc": "colwise"}
        ),
        "shared in a stage": lambda: Pipeline(
            _shared_within_a_stage(), [2, 2], tensor_parallel=2, tp_plan={"0": "colwise"}
        ),
        "layer type": lambda: Pipeline(
            gpt(), [2, 2], tensor_parallel=2, tp_plan={"1.ln1": "colwise"}
        ),
    }
    for what, attempt in attempts.items():
        try:
            attempt()
        except (ValueError, TypeError) as exc:
            found[what] = str(exc)
        else:
            found[what] = "accepted"
    return found


def data_tensor_pipeline() -> dict:
    """D = 2 x T = 2 x K = 2 on 8 processes: replicas whole (1f1b) and sharded over the data
    dimension with fully_shard, 2-D with the tensor split (zero-bubble, whose last W
    reduces), each exact as ``exactness`` says."""
    whole = exactness(("1f1b",), data_parallel=2)
    sharded = exactness(("zero-bubble",), data_parallel=2, shard="full")
    return {"whole": whole["cases"], "sharded": sharded["cases"], "split": sharded["split"]}


def vocabulary_parallel_loss() -> dict:
    """loss_parallel=True: the logits stay split by vocabulary and the cross-entropy runs
    over the shards, with the unsplit model's loss and gradients (split backward and
    recomputation included); forward_only still gives whole log-probabilities."""
    done = {}
    for schedule, mode in (("1f1b", "never"), ("zero-bubble", "always")):
        pipe = Pipeline(
            gpt(),
            [2, 2],
            chunks=2,
            checkpoint=mode,
            schedule=schedule,
            loss_fn=lm_loss,
            tensor_parallel=T,
            loss_parallel=True,
            timeout=30,
        )
        reference = gpt()
        x, y = tokens(4, seed=8)
        result = pipe.step(*_ends(pipe, x, y), return_outputs=True)
        expected = lm_loss(reference(x), y)
        expected.backward()
        torch.testing.assert_close(result.loss, expected.detach(), **EXACT)
        _check_gradients(pipe, reference)
        if pipe.is_last:  # each rank holds its half of the vocabulary
            assert isinstance(result.outputs, DTensor)
            assert result.outputs.to_local().shape[-1] == CONFIG.vocab_size // T
        done[schedule] = True
    logprobs = pipe.forward_only(*_ends(pipe, x, y))
    if pipe.is_last:
        with torch.no_grad():
            want = torch.log_softmax(reference(x), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logprobs, want, **GRADIENTS)
    return done


def ranks_draw_alike() -> dict:
    """Processes seeded apart (``torch.manual_seed(rank)``, as data-parallel scripts do) at
    T = 2: the tensor ranks of a stage still drop out alike in a step, so the gradients of
    the parameters they keep whole are equal; and ``generate`` samples alike with no seed."""
    config = GPTConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, dropout=0.3)
    torch.manual_seed(0)
    pipe = Pipeline(
        build_gpt(config).double(), [2, 2], chunks=2, loss_fn=lm_loss, tensor_parallel=T
    )
    torch.manual_seed(dist.get_rank())
    x, y = tokens(4, seed=9)
    pipe.step(*_ends(pipe, x, y))
    whole = [p.grad.flatten() for p in pipe.parameters() if not isinstance(p, DTensor)]
    pipe.eval()
    sampled = pipe.generate([[5, 6, 7], [8, 9]], 6, temperature=1.0)
    return {"whole gradients": torch.cat(whole).tolist(), "sampled": sampled}
