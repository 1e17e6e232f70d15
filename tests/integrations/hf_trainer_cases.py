"""What the processes of tests/integrations/test_transformers.py run, and what the test's
own process builds the same way: a tiny Llama (float32, no dropout), a small set of
token rows of varied lengths (padding, so that micro-batches differ in valid tokens), the
arguments both trainers get, and a byte-level tokenizer for TRL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..small_models import tiny_llama_config

STEPS = 20
SAVE_AT = 10
REPLICA_STEPS = 10


def model(seed: int = 0) -> Any:
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_cache=False,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of 6 to 16 random tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 17, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, 64, (n_,), generator=g)} for n_ in lengths]


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padded rows, the padding masked and labelled -100."""
    width = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def arguments(out: str | Path, **more: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = {
        "output_dir": str(out), "max_steps": STEPS, "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4, "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2, "lr_scheduler_type": "cosine", "warmup_steps": 3,
        "max_grad_norm": 0.5, "logging_steps": 1, "save_strategy": "steps",
        "save_steps": SAVE_AT, "report_to": [], "seed": 1, "use_cpu": True,
        "disable_tqdm": True, "ddp_timeout": 60,
    }  # fmt: skip
    options.update(more)
    return TrainingArguments(**options)


def trainer_inputs(out: str | Path, **more: Any) -> dict[str, Any]:
    """What the plain ``Trainer`` and ``PipelineTrainer`` are both given."""
    return {
        "model": model(),
        "args": arguments(out, **more),
        "train_dataset": rows(64, 1),
        "eval_dataset": rows(10, 2),
        "data_collator": collate,
    }


def gpt2_inputs(out: str | Path) -> dict[str, Any]:
    """An untrained GPT-2, whose class names no loss type (the Trainer then counts every
    label of an evaluation batch, not the shifted ones it predicts), to evaluate."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    model = GPT2LMHeadModel(config)
    return {
        "model": model,
        "args": arguments(out),
        "eval_dataset": rows(10, 2),
        "data_collator": collate,
    }


def gpt2_evaluated(out: str) -> tuple[float, list[str]]:
    """The pipelined GPT-2's evaluation loss, and the model's names of the parameters its
    optimizer would decay on this rank."""
    from gpipe.integrations.transformers import PipelineTrainer

    trainer = PipelineTrainer(**gpt2_inputs(out), chunks=2)
    model = trainer.model
    decayed = [
        model.split.original_name(name.removeprefix("pipeline."))
        for name in trainer.get_decay_parameter_names(model)
    ]
    return trainer.evaluate()["eval_loss"], decayed


GROUPED = {"train_sampling_strategy": "group_by_length", "max_steps": 4, "save_strategy": "no"}


def grouped_losses(out: str) -> list[float]:
    """Four steps of batches grouped by length: a sampler that draws from the global random
    state, where accelerate's seeded one does not stand in."""
    from gpipe.integrations.transformers import PipelineTrainer

    trainer = PipelineTrainer(**trainer_inputs(out, **GROUPED), chunks=2)
    trainer.train()
    return losses(trainer)


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def pipelined_run(out: str) -> dict[str, Any]:
    """One process of K = 2: train 20 steps (a checkpoint at 10), evaluate, predict, save;
    then resume from the checkpoint in a fresh trainer, and train 3 steps (under a V
    schedule) from the same model built on meta, its weights read from a folder, saving
    the weights alone, and resume from them."""
    import torch.distributed as dist
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from gpipe.integrations.transformers import PipelineTrainer

    trainer = PipelineTrainer(**trainer_inputs(out), chunks=2)
    trainer.train()
    found: dict[str, Any] = {"losses": losses(trainer), "stage": type(trainer.split[0]).__name__}
    found["total_flos"] = trainer.state.total_flos
    found["num_parameters"] = trainer.model.num_parameters(exclude_embeddings=True)
    evaluated = trainer.evaluate()
    found["eval_loss"], found["eval_keys"] = evaluated["eval_loss"], sorted(evaluated)
    predicted = trainer.predict(rows(6, 3))
    found["predictions"] = torch.as_tensor(predicted.predictions)
    found["label_ids"] = torch.as_tensor(predicted.label_ids)
    trainer.save_model(f"{out}/final")
    mine = trainer.split.original_state_dict(module=trainer.pipeline)
    saved = LlamaForCausalLM.from_pretrained(f"{out}/final").state_dict()
    found["saved_equal"] = all(torch.equal(v, saved[k]) for k, v in mine.items())
    found["checkpoint"] = sorted(os.listdir(f"{out}/checkpoint-{SAVE_AT}"))

    resumed = PipelineTrainer(**trainer_inputs(out, save_strategy="no"), chunks=2)
    resumed.train(resume_from_checkpoint=f"{out}/checkpoint-{SAVE_AT}")
    found["resumed"] = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}

    if dist.get_rank() == 0:
        model().save_pretrained(f"{out}/initial")
    dist.barrier()
    with init_empty_weights():  # parameters on meta, buffers (rotary tables) real
        empty = LlamaForCausalLM(model().config)
    model_only = {"max_steps": 3, "save_steps": 3, "save_only_model": True}
    start = trainer_inputs(f"{out}/model-only", **model_only) | {"model": empty}
    weights = f"{out}/initial"
    # under a V schedule: 4 stages, 2 a process (it was cut into 2, which it could not run)
    from_meta = PipelineTrainer(**start, chunks=2, weights=weights, schedule="zero-bubble-v")
    from_meta.train()
    found["from_meta"] = losses(from_meta)
    # a checkpoint of the weights alone resumes with a fresh optimizer, as the plain Trainer's
    found["model_only"] = sorted(os.listdir(f"{out}/model-only/checkpoint-3"))
    from_meta.train(resume_from_checkpoint=f"{out}/model-only/checkpoint-3")
    return found


def replicas_run(out: str) -> list[float]:
    """Two replicas of a one-stage pipeline (K = 1, D = 2), each on half of the data."""
    from gpipe.integrations.transformers import PipelineTrainer

    inputs = trainer_inputs(out, max_steps=REPLICA_STEPS, save_strategy="no")
    trainer = PipelineTrainer(**inputs, chunks=2, data_parallel=2)
    trainer.train()
    return losses(trainer)


def world_not_k_times_d(out: str) -> str:
    from gpipe.integrations.transformers import PipelineTrainer

    try:
        PipelineTrainer(**trainer_inputs(out), data_parallel=3)
    except ValueError as exc:
        return str(exc)
    return "no error"


def tokenizer() -> Any:
    """A byte-level tokenizer with no merges: 256 byte tokens, pad and end of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *alphabet])}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>")


def sft_trainer(out: str, pipelined_over: int | None, **options: Any) -> Any:
    """TRL's SFT recipe on prompt-completion pairs (sums): pipelined over the processes'
    stages with ``pipelined_over`` chunks, or (None) the plain SFTTrainer; ``options``
    change SFTConfig's."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from gpipe.integrations.transformers import pipelined

    tok = tokenizer()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 50, (2, 160), generator=g).tolist()
    pairs = Dataset.from_dict(
        {
            "prompt": [f"{x}+{y}=" for x, y in zip(a, b, strict=True)],
            "completion": [str(x + y) for x, y in zip(a, b, strict=True)],
        }
    )
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    settings: dict[str, Any] = {
        "output_dir": out, "max_steps": 16, "per_device_train_batch_size": 8,
        "learning_rate": 3e-3, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "save_strategy": "no", "disable_tqdm": True, "max_length": 16, "ddp_timeout": 60,
    }  # fmt: skip
    args = SFTConfig(**{**settings, **options})
    given = {"model": LlamaForCausalLM(config), "args": args, "train_dataset": pairs}
    if pipelined_over is None:
        return SFTTrainer(**given, processing_class=tok)
    return pipelined(SFTTrainer)(**given, processing_class=tok, chunks=pipelined_over)


def sft_run(out: str) -> list[float]:
    """The SFT recipe pipelined over 2 processes, with SFTConfig's defaults for gradient
    checkpointing and bf16."""
    trainer = sft_trainer(out, 2)
    assert trainer.args.gradient_checkpointing and trainer.args.bf16  # TRL's, honoured
    trainer.train()
    return losses(trainer)


PADDING_FREE = {
    "padding_free": True, "max_length": None, "max_steps": 6, "bf16": False,
    "gradient_checkpointing": False,
}  # fmt: skip


def padding_free_losses(out: str) -> list[float]:
    """Rows laid end to end in one, told apart by their position ids."""
    trainer = sft_trainer(out, 2, **PADDING_FREE)
    trainer.train()
    return losses(trainer)
