"""Hugging Face's Trainer, pipelined: ``PipelineTrainer`` on K = 2 processes trains as the
plain ``Trainer`` does in one (loss for loss, step for step), evaluates and predicts alike,
saves a folder ``from_pretrained`` loads, and resumes from its checkpoints;
``pipelined(SFTTrainer)`` fine-tunes with TRL's recipe; what it cannot honour is refused in
one line. Real processes over gloo (the module's shared ones), no mocks."""

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("trl", reason="the test extra installs trl")

from transformers import LlamaForCausalLM, Trainer, TrainingArguments

from gpipe.integrations.hf_options import refused_options
from gpipe.integrations.transformers import PipelineTrainer, pipelined

from .. import workers
from . import hf_trainer_cases as cases


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer in this one process, on the same model, data and arguments."""
    out = tmp_path_factory.mktemp("plain")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each pipelined process runs
    try:
        trainer = Trainer(**cases.trainer_inputs(out, save_strategy="no"))
        trainer.train()
        predicted = trainer.predict(cases.rows(6, 3))
        evaluated = trainer.evaluate()
        return {
            "losses": cases.losses(trainer),
            "total_flos": trainer.state.total_flos,
            "num_parameters": trainer.model.num_parameters(exclude_embeddings=True),
            "eval_loss": evaluated["eval_loss"],
            "eval_keys": sorted(evaluated),
            "predictions": torch.as_tensor(predicted.predictions),
            "label_ids": torch.as_tensor(predicted.label_ids),
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        }
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipelined")
    return workers.run(cases.pipelined_run, 2, (str(out),)), out


def test_losses_step_for_step_as_the_plain_trainer(plain, pipelined_run):
    found, _ = pipelined_run
    assert found[0]["stage"] == "PlanStage"  # Llama declares a plan: cut by it
    mine, theirs = found[0]["losses"], plain["losses"]
    assert len(mine) == len(theirs) == cases.STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine, theirs, strict=True))
    print(f"largest relative difference over {cases.STEPS} logged losses: {worst:.2e}")
    assert worst <= 1e-5
    assert found[1]["losses"] == mine  # every rank logs the same
    # the operations counted once a replica (they were 0: the Trainer counts by the model's
    # num_parameters), of the whole model with its tied head once (it was counted twice)
    assert found[0]["num_parameters"] == found[1]["num_parameters"] == plain["num_parameters"]
    assert found[0]["total_flos"] == found[1]["total_flos"] == plain["total_flos"] > 0


def test_batches_grouped_by_length_come_in_the_plain_trainers_order(tmp_path):
    """Its sampler draws from the global random state, which each stage's dropout moves
    apart: every rank takes rank 0's order, drawn as one process draws it (they were given
    a generator of their own, the same batches in another order: 4.170 against 4.142)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(**cases.trainer_inputs(tmp_path / "plain", **cases.GROUPED))
        trainer.train()
        plain = cases.losses(trainer)
    finally:
        torch.set_num_threads(threads)
    found = workers.run(cases.grouped_losses, 2, (str(tmp_path / "pipelined"),))
    assert found[0] == found[1] and len(plain) == 4
    assert found[0] == pytest.approx(plain, rel=1e-5)


def test_evaluation_and_predictions_as_the_plain_trainer(plain, pipelined_run):
    found, _ = pipelined_run
    for rank in (0, 1):
        assert found[rank]["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
        # the model counts as prepared: no eval_model_preparation_time the plain one lacks
        assert found[rank]["eval_keys"] == plain["eval_keys"]
        torch.testing.assert_close(
            found[rank]["predictions"], plain["predictions"], rtol=1e-4, atol=5e-4
        )
        assert torch.equal(found[rank]["label_ids"], plain["label_ids"])


def test_a_model_without_a_loss_type_evaluates_as_the_plain_trainer(tmp_path):
    """GPT-2's class names no loss type, so the plain Trainer divides an evaluation batch's
    loss by all its labels, one more a row than it predicts: the pipelined one counts
    alike (it counted the shifted ones: 4.549 against 4.170 on unpadded rows)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(**cases.gpt2_inputs(tmp_path / "plain"))
        plain = trainer.evaluate()["eval_loss"]
    finally:
        torch.set_num_threads(threads)
    found = workers.run(cases.gpt2_evaluated, 2, (str(tmp_path / "pipelined"),))
    for rank in (0, 1):
        assert found[rank][0] == pytest.approx(plain, rel=1e-5)
    # weight decay spares the norms as the plain Trainer's does: a traced stage holds them in
    # plain modules, which the Trainer's test of the layer's type missed (ln_1, ln_2, ln_f)
    decayed = trainer.get_decay_parameter_names(trainer.model)
    tied_head = {"lm_head.weight"}  # the embedding, which both stages hold, by its name
    assert set(found[0][1] + found[1][1]) == set(decayed) - tied_head


def test_the_saved_folder_is_the_trained_model(plain, pipelined_run):
    found, out = pipelined_run
    assert found[0]["saved_equal"] and found[1]["saved_equal"]  # each stage's, exactly
    saved = LlamaForCausalLM.from_pretrained(out / "final")
    assert saved.config.tie_word_embeddings
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, plain["weights"][name], rtol=1e-4, atol=1e-5)
    # the tied head is written once, as the model's own save_pretrained writes it
    saved.save_pretrained(out / "resaved")
    assert _tensor_names(out / "final") == _tensor_names(out / "resaved")


def _tensor_names(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return set(weights.keys())


def test_a_checkpoint_resumes_to_the_same_losses(pipelined_run):
    found, _ = pipelined_run
    expected = {
        "model.safetensors", "optimizer.stage-0-of-2.pt", "optimizer.stage-1-of-2.pt",
        "scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
    }  # fmt: skip
    assert expected <= set(found[0]["checkpoint"])
    first = dict(enumerate(found[0]["losses"], start=1))
    resumed = found[0]["resumed"]
    assert sorted(resumed) == list(range(1, cases.STEPS + 1))  # its history, then its own
    assert all(resumed[step] == first[step] for step in range(cases.SAVE_AT + 1, cases.STEPS + 1))


def test_a_model_built_on_meta_reads_its_stage_from_a_folder(pipelined_run):
    """It trains under a V schedule (two stages a process) to the losses of the same
    weights under gpipe."""
    found, _ = pipelined_run
    assert found[0]["from_meta"] == pytest.approx(found[0]["losses"][:3], rel=1e-6)


def test_a_checkpoint_of_the_weights_alone_resumes(pipelined_run):
    """save_only_model=True writes no optimizer state: resuming takes a fresh one, as the
    plain Trainer does (it was refused for lacking optimizer.stage-0-of-2.pt)."""
    found, _ = pipelined_run
    assert "model.safetensors" in found[0]["model_only"]
    assert not any(name.startswith("optimizer") for name in found[0]["model_only"])


def test_replicas_share_the_global_batch_as_one_process_does(tmp_path):
    """D = 2 replicas of per_device_train_batch_size 4 train as the plain Trainer in one
    process on batches of 8: the data sharded over the replicas, tokens counted over both."""
    found = workers.run(cases.replicas_run, 2, (str(tmp_path / "replicas"),))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        more = {"max_steps": cases.REPLICA_STEPS, "save_strategy": "no"}
        trainer = Trainer(
            **cases.trainer_inputs(tmp_path / "plain", **more, per_device_train_batch_size=8)
        )
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    assert found[0] == found[1]
    assert found[0] == pytest.approx(cases.losses(trainer), rel=1e-5)


def test_sft_trainer_pipelined_fine_tunes(tmp_path):
    losses = workers.run(cases.sft_run, 2, (str(tmp_path),))[0]
    print(f"SFT losses {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0


def test_sft_padding_free_trains_as_the_plain_sft_trainer(tmp_path):
    """Rows laid end to end, told apart by position ids that the stages take (it was
    refused as if they did not)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = cases.sft_trainer(str(tmp_path / "plain"), None, **cases.PADDING_FREE)
        trainer.train()
        plain = cases.losses(trainer)
    finally:
        torch.set_num_threads(threads)
    found = workers.run(cases.padding_free_losses, 2, (str(tmp_path / "pipelined"),))
    assert len(plain) == 6 and found[0] == pytest.approx(plain, rel=1e-5)


def test_a_world_that_is_not_k_times_d_is_one_line(tmp_path):
    message = workers.run(cases.world_not_k_times_d, 2, (str(tmp_path),))[0]
    assert message.startswith("the world size 2 is not K x D for data_parallel D=3")
    assert "\n" not in message


# -- refused before any process group is needed ------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("label_smoothing_factor", 0.1),
        ("neftune_noise_alpha", 5.0),
        ("torch_compile", True),
        ("auto_find_batch_size", True),
        ("activation_checkpointing_kwargs", {"use_reentrant": False, "every_n_layers": 2}),
        ("train_sampling_strategy", "batch_rebalance"),
    ],
)
def test_an_option_the_pipeline_cannot_honour_is_one_line(tmp_path, option, value):
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], **{option: value}
    )
    with pytest.raises(
        ValueError, match=rf"^PipelineTrainer cannot honour TrainingArguments\({option}="
    ) as e:
        PipelineTrainer(model=cases.model(), args=args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("reentrant", [False, True])
def test_use_reentrant_alone_is_not_refused(tmp_path, reentrant):
    # scripts pass it with gradient_checkpointing=True; both values give the same gradients
    # as the pipeline's non-reentrant re-materialization of whole stages
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        gradient_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": reentrant},
    )
    assert refused_options(args) == []


def test_trainer_arguments_it_cannot_take(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    model = cases.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="cannot take optimizers="):
        PipelineTrainer(model=model, args=args, optimizers=(optimizer, None))
    with pytest.raises(ValueError, match="cannot take model_init="):
        PipelineTrainer(model=None, args=args, model_init=cases.model)
    with pytest.raises(ValueError, match="pipelines Hugging Face models .* got a Linear"):
        PipelineTrainer(model=torch.nn.Linear(2, 2), args=args)
    with pytest.raises(ValueError, match="chunks must be a positive integer, got 0"):
        PipelineTrainer(model=model, args=args, chunks=0)
    with pytest.raises(ValueError, match="schedule must be one of .*, got 'fifo'"):
        PipelineTrainer(model=model, args=args, schedule="fifo")  # before the process group
    with pytest.raises(ValueError, match="schedule='auto' is not taken by PipelineTrainer"):
        PipelineTrainer(model=model, args=args, schedule="auto")  # it needs a sample batch
    with pytest.raises(ValueError, match="launch the script with torchrun --nproc-per-node K\\*D"):
        PipelineTrainer(model=model, args=args)  # this process has no process group


def test_what_the_pipelines_loss_would_not_train_is_refused(tmp_path):
    """A model whose loss is not the shifted causal-LM loss (a classifier, a masked LM)
    trained on that loss all the same; a compute_loss of one's own never ran. TRL's own
    compute_loss, which only adds metrics, is not refused."""
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from trl import SFTTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    classifier = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=16, n_head=2))
    with pytest.raises(ValueError, match="trains causal language models .* got a GPT2For"):
        PipelineTrainer(model=classifier, args=args)

    class Tripled(PipelineTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            return 3 * super().compute_loss(model, inputs, **kwargs)

    with pytest.raises(ValueError, match=r"^PipelineTrainer cannot run Tripled\.compute_loss"):
        Tripled(model=cases.model(), args=args)
    with pytest.raises(ValueError, match="launch the script with torchrun"):  # past the checks
        pipelined(SFTTrainer)(model=cases.model(), args=args)


def test_dpo_is_refused_by_its_loss(tmp_path):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(ValueError, match=r"loss_type=.*causal-LM loss \(nll\)"):
        pipelined(DPOTrainer)(model=cases.model(), args=args)


def test_pipelined_makes_one_class_per_trainer_class():
    from trl import SFTTrainer

    assert pipelined(Trainer) is PipelineTrainer
    made = pipelined(SFTTrainer)
    assert made is pipelined(SFTTrainer) and issubclass(made, SFTTrainer)
    assert pipelined(made) is made
    with pytest.raises(TypeError, match="pipelined\\(\\) takes a Trainer class"):
        pipelined(int)  # type: ignore[type-var]
