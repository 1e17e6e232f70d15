"""Hugging Face model families that declare a pipeline plan, built from tiny configs, and the
check that a model cut by its plan computes what the unsplit model does (float64: the loss
and every gradient).

``python -m tests.splitting.hf_families`` runs the check on every family the installed
transformers declares a plan for and prints the table docs/split.md keeps;
``--without-plan``, on every causal LM family that declares none (its layout read from its
modules), then greedy generation through the stages of those that are equal.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from typing import Any

import torch

import gpipe

SIZES = {  # every size a config may name, made tiny
    "hidden_size": 32,
    "n_embd": 32,
    "intermediate_size": 64,
    "n_inner": 64,
    "num_hidden_layers": 4,
    "n_layer": 4,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 96,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "rotary_dim": 4,
    "sliding_window": 16,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
TOO_LARGE = 20_000_000  # parameters: more is a config the sizes above did not shrink
DROPOUTS = (  # dropout probabilities, or noise drawn in training, under names without "dropout"
    "hidden_dropout",
    "attention_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "router_jitter_noise",
    "input_jitter_noise",
)


def families(declared: bool = True) -> list[str]:
    """The model types with a causal LM class whose config declares a pipeline plan (or,
    with ``declared=False``, declares none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [
        kind
        for kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if kind in CONFIG_MAPPING
        and bool(getattr(CONFIG_MAPPING[kind], "base_model_pp_plan", None)) == declared
    ]


def tiny_config(kind: str, **overrides: Any) -> Any:
    """The family's default config with every size made tiny and dropout off."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[kind]
    default = cls()
    small = {k: v for k, v in SIZES.items() if hasattr(default, k)}
    if hasattr(default, "kv_lora_rank"):  # multi-head latent attention: rope on part of a head
        small.update(head_dim=4, qk_head_dim=8)
    dropouts = [k for k in default.to_dict() if "dropout" in k or k in DROPOUTS]
    small.update({k: 0.0 for k in dropouts if isinstance(getattr(default, k, None), float)})
    small.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    small.update(overrides)
    kept = {k: v for k, v in default.to_dict().items() if k not in small and k != "layer_types"}
    try:
        return cls(**{**kept, **small})
    except Exception:  # a config whose derived fields disagree with the kept ones
        return cls(**small)


def build(kind: str, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    """The family's causal LM from its tiny config, in training mode."""
    import transformers

    config = tiny_config(kind, **overrides)
    auto = transformers.AutoModelForCausalLM
    with torch.device("meta"):  # a config of sub-configs our sizes miss (BLT's) stays large
        count = sum(p.numel() for p in auto.from_config(config).parameters())
    if count > TOO_LARGE:
        raise ValueError(f"the tiny config still has {count:,} parameters")
    try:  # mixture-of-experts kernels take no float64: the plain loop over experts does
        model = auto.from_config(config, dtype=dtype, experts_implementation="eager")
    except (TypeError, ValueError):
        model = auto.from_config(config, dtype=dtype)
    return model.train()


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def run_stages(stages: Any, inputs: Any) -> Any:
    for stage in stages:
        inputs = stage(inputs)
    return inputs


class Unbuildable(RuntimeError):
    """The family's model does not build or run unsplit from the tiny config."""


def check_family(kind: str, parts: int = 2, **overrides: Any) -> list[str]:
    """Cut the family's tiny model by its plan into ``parts`` stages and check the loss and
    every gradient against the unsplit model's; returns where the stages begin."""
    torch.manual_seed(0)
    try:
        model = build(kind, **overrides)
        ids = torch.randint(3, model.config.vocab_size, (2, 12))
        expected = next_token_loss(model(input_ids=ids, use_cache=False).logits, ids)
        expected.backward()
    except Exception as exc:  # the tiny config does not suit the family
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unbuildable(f"does not build or run unsplit from a tiny config: {first}") from exc
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    stages = gpipe.split(model, parts=parts, plan="hf")
    loss = next_token_loss(run_stages(stages, ids).logits, ids)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for name, param in model.named_parameters():
        if name in grads:
            assert param.grad is not None, f"{name} has no gradient through the stages"
            torch.testing.assert_close(param.grad, grads[name], rtol=1e-9, atol=1e-12, msg=name)
    return list(stages.at)


def _generates(kind: str) -> str:
    """Whether greedy generation through the family's stages is the model's own."""
    from .test_hf_generation import generated, reference, wide

    try:
        model = wide(kind)
        g = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 9, 1, 13)]
        want = reference(model, prompts)
        for parts in (2, 3):
            stages = list(gpipe.split(model, parts=parts, plan="hf"))
            if generated(stages, prompts, lanes=3, chunk=3) != want:
                return f"generates **other tokens** on {parts} stages"
        return "generates the same tokens"
    except Exception as exc:  # the table says why
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"does not generate: {type(exc).__name__}: {first[:120]}"


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    read = "--without-plan" in (sys.argv[1:] if argv is None else argv)
    print("| family | result |\n|---|---|")
    for kind in families(declared=not read):
        began = time.perf_counter()
        try:
            at = check_family(kind)
            result = f"equal (stage 2 begins at `{at[0]}`)"
            if read:
                result += "; " + _generates(kind)
        except Unbuildable as exc:
            result = f"not checked: {str(exc)[:150]}"
        except Exception as exc:  # the table says why
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            result = f"**differs or refused**: {type(exc).__name__}: {first[:150]}"
        print(f"| {kind} | {result} | {time.perf_counter() - began:.1f} s", file=sys.stderr)
        print(f"| {kind} | {result} |", flush=True)


if __name__ == "__main__":
    main()
