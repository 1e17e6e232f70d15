"""Fine-tuning a Llama with Hugging Face's ``Trainer``, pipelined: two lines change.

This is the plain ``Trainer`` recipe for a causal language model (a tokenizer, a text set,
``DataCollatorForLanguageModeling``, ``TrainingArguments``), with ``Trainer`` replaced by
``gpipe.integrations.transformers.PipelineTrainer`` and ``chunks=`` added. Launched with
torchrun, every process runs this same script: each builds the model, and the trainer
cuts it by its own pipeline plan, keeps one stage per process and frees the rest.

The model is a small Llama built from a config (nothing downloaded); the text is
paragraphs of this Python's standard library, through a byte-level tokenizer built here.
The script prints the evaluation loss before and after, saves the model as an ordinary
Hugging Face folder, and checks on rank 0 that ``from_pretrained`` gives the same loss.

    pip install '.[hf]'
    torchrun --nproc-per-node 2 examples/hf_trainer.py                      # K = 2 stages
    torchrun --nproc-per-node 4 examples/hf_trainer.py --data-parallel 2    # 2 replicas of 2
"""

from __future__ import annotations

import argparse
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainingArguments,
)

from gpipe.data import stdlib_corpus
from gpipe.integrations.transformers import PipelineTrainer  # 1: instead of Trainer


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes as tokens (GPT-2's byte-level alphabet, no merges), plus pad and end of text."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", *alphabet])}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>")


class Paragraphs(Dataset[dict[str, list[int]]]):
    """Paragraphs of text as token ids, each at most ``length`` tokens."""

    def __init__(self, texts: list[str], tokenizer: PreTrainedTokenizerFast, length: int):
        self.rows = tokenizer(texts, truncation=True, max_length=length)["input_ids"]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[index]}


def text_set(count: int) -> list[str]:
    """``count`` paragraphs of the standard library's sources, of 80 characters or more."""
    text = stdlib_corpus(2_000_000).decode("utf-8", errors="replace")
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 80]
    return paragraphs[:count]


def evaluation_loss(model: torch.nn.Module, data: Dataset, collate, batch: int) -> float:
    """The mean over batches of each batch's loss, as ``Trainer.evaluate`` reduces it."""
    losses = []
    with torch.no_grad():
        for start in range(0, len(data), batch):
            rows = collate([data[i] for i in range(start, min(start + batch, len(data)))])
            losses.append(float(model(**rows).loss) * len(rows["input_ids"]))
    return sum(losses) / len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--out", default="hf-trainer-llama")
    args = parser.parse_args()

    tokenizer = byte_tokenizer()
    texts = text_set(1200)
    train, held_out = (
        Paragraphs(texts[:1152], tokenizer, 96),
        Paragraphs(texts[1152:], tokenizer, 96),
    )
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # pads; -100 on padding
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # the same on every rank
    training = TrainingArguments(
        output_dir=f"{args.out}-checkpoints",
        max_steps=args.steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=4,
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # a plain Trainer needs it too on CPU processes
    )
    trainer = PipelineTrainer(  # 2: chunks, the micro-batches of each batch
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=collate,
        processing_class=tokenizer,
        chunks=args.chunks,
        data_parallel=args.data_parallel,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(args.out)
    if int(os.environ.get("RANK", "0")) == 0:
        pipe = trainer.pipeline
        print(
            f"pipelined Llama ({pipe.n_stages} stages x {args.data_parallel} replicas, "
            f"chunks={args.chunks}): eval loss {before:.4f} -> {after:.4f} in {args.steps} steps"
        )
        saved = AutoModelForCausalLM.from_pretrained(args.out).eval()
        again = evaluation_loss(saved, held_out, collate, training.per_device_eval_batch_size)
        print(f"from_pretrained({args.out!r}): eval loss {again:.4f}")


if __name__ == "__main__":
    main()
