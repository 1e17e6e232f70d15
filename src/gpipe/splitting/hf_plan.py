"""Cut a Hugging Face causal LM by its own pipeline plan (``base_model_pp_plan``).

A model class that declares a plan names, in order, the modules of its base model that a
pipeline runs: the embedding (and maybe a dropout), the list of decoder layers, the final
norm. Here each stage keeps the model's *real* modules — a contiguous slice of the decoder
layers, the embedding on the first stage, the final norm and the output head on the last —
and runs the model's own ``forward``, so its attention implementation (sdpa, eager, flash),
its masks, rotary tables and cache classes work as they do unsplit.

Each stage holds a *shell* of the model: a copy of its small parts (config, rotary
embedding, the containers) around the real modules it keeps, with a stand-in for each
module it does not: a decoder layer of another stage passes the hidden states through
(the one just before the stage's first layer hands over the hidden states received from
the stage before), a norm of a later stage is an identity, an embedding of the first stage
gives a zero (what it gives never reaches the later stage's layers), a head of the last
stage refuses to run. A stage other than the last runs the base model and sends
its hidden states, with the model's other arguments (``attention_mask``,
``position_ids`` ...), to the next; the last runs the whole causal LM and returns what the
model returns. Token embeddings tied to the output head stay one ``nn.Parameter``, which
the pipeline treats as any tie across stages.

Where the plan lies in the model, read from it where the model declares none, and where the
stages begin: ``hf_layout``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gpipe.runtime.kv_cache import CacheContext
from gpipe.splitting.hf_layout import PlanError, PlanLayout, layer_list
from gpipe.splitting.hf_tensor_plan import held_plan, model_tp_plan, torch_plan

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["HEAD_ONLY", "HeldLayer", "PlanCache", "PlanStage"]

HEAD_ONLY = ("labels", "logits_to_keep")  # arguments only the causal LM's head takes


class _StandIn(nn.Module):
    """In a stage's shell, a decoder layer another stage holds: it keeps the layer's plain
    attributes (``attention_type``, ``layer_idx`` ...) for the model's loop to read, and
    returns the hidden states it is given, or, for the layer just before the stage's first,
    the hidden states the stage received."""

    def __init__(self, layer: nn.Module, hands_over: bool, as_tuple: bool) -> None:
        super().__init__()
        for key, value in vars(layer).items():
            plain = not isinstance(value, (nn.Module, Tensor))
            if plain and not key.startswith("_") and key != "training":
                setattr(self, key, value)
        self.hands_over = hands_over
        self.as_tuple = as_tuple
        self.received: Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Tensor | tuple[Tensor]:
        if self.hands_over:
            assert self.received is not None, "a stage sets what it received before running"
            hidden = self.received
        else:
            hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden,) if self.as_tuple else hidden


class _BeforeHandOver(nn.Module):
    """In a later stage's shell, a module the first stage holds before the decoder layers
    (an embedding, its norm). The model may still call it (GPT-2 adds its position
    embeddings to the embeddings it is given), but what it gives never reaches this stage's
    layers: the layer before the stage's first hands over the hidden states received. So
    an embedding gives a zero that adds to any embeddings (a position embedding's input may
    be a mask of every token so far, not of the new ones), and any other module passes its
    input on."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.dtype = module.weight.dtype if isinstance(module, nn.Embedding) else None

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.dtype is None:
            return x
        return torch.zeros((), dtype=self.dtype, device=x.device)


class _NotHeld(nn.Module):
    """In a stage's shell, the head the last stage holds."""

    def __init__(self, name: str, index: int) -> None:
        super().__init__()
        self.what = f"stage {index} does not hold {name}; another stage runs it"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self.what)


class PlanStage(nn.Module):
    """One stage of a Hugging Face causal LM cut by its pipeline plan: the model's own modules
    for its layers ``[start, stop)`` under their original names, run by the model's own
    ``forward``. It takes the model's arguments (the first stage: a tensor of token ids, a
    tuple of positional arguments or a dict by name) or the stage before's payload, and
    returns the next stage's payload (a dict) or, on the last, what the model returns.
    It declares the model's own tensor-parallel plan for the modules it holds (``tp_plan``)."""

    shell: nn.Module  # the model's copy around this stage's modules (not a submodule)
    arg_names: list[str]  # the model's positional arguments
    hf_tp_plan: dict[str, str]  # the model's declared plan, Hugging Face's style names

    def __init__(
        self, model: nn.Module, layout: PlanLayout, index: int, bounds: Sequence[int]
    ) -> None:
        super().__init__()
        self.index, self.n_stages = index, len(bounds) - 1
        self.start, self.stop = bounds[index], bounds[index + 1]
        self.layout = layout
        self.hf_tp_plan = model_tp_plan(model, layout.base)
        shell, self._hand_over = self._shell(model)
        self.__dict__["shell"] = shell  # not registered: its children are the stage's
        for name, child in shell.named_children():
            self.add_module(name, child)
        forward = inspect.signature(type(model).forward)
        self.__dict__["arg_names"] = [
            n
            for n, p in forward.parameters.items()
            if n != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def tp_plan(self) -> dict[str, str | ParallelStyle]:
        """Tensor parallelism (``gpipe.parallel.tensor``): the model's declared plan for the
        modules this stage holds, its styles translated (``hf_tensor_plan``); refuses, when
        asked, a style with no translation, so a model with one is still cut."""
        plan = torch_plan(self.hf_tp_plan, type(self.shell).__name__)
        names = (name for name, _ in self.named_modules())
        return held_plan(plan, names, set(self._elsewhere()))

    def _elsewhere(self) -> list[str]:
        """The names of the plan's modules that other stages hold (stand-ins here)."""
        layout = self.layout
        names = [layout.layer_name(i) for i in range(layout.n_layers)]
        names = names[: self.start] + names[self.stop :]
        if not self.is_first:
            names += [f"{layout.base}.{entry}" for entry in layout.before]
        if not self.is_last:
            names += [f"{layout.base}.{entry}" for entry in layout.after] + [layout.head]
        return names

    def _shell(self, model: nn.Module) -> tuple[nn.Module, _StandIn | None]:
        """A copy of ``model`` around the modules this stage keeps: one ``deepcopy`` whose
        memo maps each module of the plan to itself (kept) or to its stand-in."""
        layout = self.layout
        base = model.get_submodule(layout.base)
        memo: dict[int, Any] = {}
        layers = layer_list(base, layout)
        hand_over = None
        for i, layer in enumerate(layers):
            if self.start <= i < self.stop:
                memo[id(layer)] = layer
            else:
                stand_in = _StandIn(
                    layer, hands_over=i == self.start - 1, as_tuple=layout.layers_return_tuples
                )
                hand_over = stand_in if stand_in.hands_over else hand_over
                memo[id(layer)] = stand_in
        for entry in layout.before:
            module = base.get_submodule(entry)
            if self.is_first:
                memo[id(module)] = module
            elif any(True for _ in module.parameters()):
                memo[id(module)] = _BeforeHandOver(module)
        for entry in layout.after:
            module = base.get_submodule(entry)
            memo[id(module)] = module if self.is_last else nn.Identity()
        head = model.get_submodule(layout.head)
        memo[id(head)] = head if self.is_last else _NotHeld(layout.head, self.index)
        return copy.deepcopy(model, memo), hand_over

    def _arguments(self, x: Any) -> dict[str, Any]:
        """The first stage: the model's arguments by name."""
        if isinstance(x, Tensor):
            return {"input_ids": x}
        if isinstance(x, Mapping):
            return dict(x)
        if isinstance(x, (tuple, list)):
            if len(x) > len(self.arg_names):
                raise TypeError(
                    f"the model takes at most {len(self.arg_names)} positional arguments "
                    f"({self.arg_names}), got {len(x)}"
                )
            return dict(zip(self.arg_names, x, strict=False))
        raise TypeError(
            "a split model takes a tensor of token ids, a tuple of positional arguments or a "
            f"dict of arguments by name, got {type(x).__name__}"
        )

    def forward(self, x: Any) -> Any:
        shell = self.shell
        shell.training = self.training
        if self.is_first:
            kwargs = self._arguments(x)
        else:
            if not isinstance(x, Mapping) or "hidden_states" not in x:
                raise RuntimeError(
                    f"plan stage {self.index} expected the hidden states of the stage before "
                    f"it, got {type(x).__name__}"
                )
            kwargs = dict(x)
            received = kwargs.pop("hidden_states")
            # the base model embeds nothing here: what it starts from is replaced, at the
            # layer before this stage's first, by the hidden states received
            kwargs["inputs_embeds"] = torch.zeros_like(received)
            assert self._hand_over is not None
            self._hand_over.received = received
        kwargs.setdefault("use_cache", False)
        try:
            if self.is_last:
                return shell(**kwargs)
            body = {k: v for k, v in kwargs.items() if k not in HEAD_ONLY}
            hidden = shell.get_submodule(self.layout.base)(**body).last_hidden_state
        finally:
            if self._hand_over is not None:
                self._hand_over.received = None
        passed_on = {
            k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs_embeds", "use_cache")
        }
        return {"hidden_states": hidden, **passed_on}

    # -- generation (gpipe.runtime.kv_cache) ---------------------------------------------------
    def new_cache(self) -> PlanCache:
        """The model's own ``DynamicCache`` for one group of sequences: a layer for each place
        this stage's decoder layers update (``_cache_places``); the others' places point at
        the stage's first, since the model sizes its masks by asking the cache about its
        first layer."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        cache = DynamicCache()
        if not hasattr(cache, "layers"):
            import transformers

            raise RuntimeError(
                "generate() through a model cut by its plan needs a transformers whose caches "
                f"are lists of layers (4.56 or later); this is {transformers.__version__}"
            )
        self._check_causal()
        places = self._cache_places()
        self._check_attention_only(DynamicCache, places, (DynamicLayer, DynamicSlidingWindowLayer))
        held = {place: DynamicLayer() for place in places}
        first = held[places[0]]
        n = max(self.layout.n_layers, max(places) + 1)
        cache.layers = [held.get(i, first) for i in range(n)]
        return PlanCache(cache, [HeldLayer(layer) for layer in held.values()])

    def _cache_places(self) -> list[int]:
        """The places in the model's cache that this stage's decoder layers update: the
        ``layer_idx`` of the modules inside each layer (its attention; two in a LongCat-Flash
        layer, at twice the layer's index and the next), or the layer's own index where no
        module inside it names one."""
        layers = layer_list(self.shell.get_submodule(self.layout.base), self.layout)
        places: list[int] = []
        for i in range(self.start, self.stop):
            inside = {
                module.layer_idx
                for name, module in layers[i].named_modules()
                if name and isinstance(getattr(module, "layer_idx", None), int)
            }
            places += sorted(inside) if inside else [i]
        return places

    def _check_causal(self) -> None:
        """Refuse attention that sees later tokens (a Gemma built with
        ``use_bidirectional_attention``): a token's keys and values kept for later ones, or
        a sequence cut into sub-sequences, give such a model other results than its whole
        forward. Hugging Face's attention modules say so by ``is_causal``."""
        layers = layer_list(self.shell.get_submodule(self.layout.base), self.layout)
        for i in range(self.start, self.stop):
            for name, module in layers[i].named_modules():
                if getattr(module, "is_causal", True) is False:
                    raise PlanError(
                        f"{type(self.shell).__name__}'s layer {i} ({name or 'the layer'}) "
                        "attends to later tokens (is_causal=False): generate() and "
                        "seq_chunks need causal attention"
                    )

    def _check_attention_only(
        self, cache_class: Any, places: Sequence[int], plain: tuple[type, ...]
    ) -> None:
        """Refuse layers whose cache holds more than keys and values (linear attention, state
        space models, a sparse attention's indexer keys): their state cannot be padded,
        joined and trimmed row by row as keys and values are."""
        try:
            typed = cache_class(config=self.shell.config).layers
        except (TypeError, ValueError, AttributeError, KeyError):
            return  # no layer types to read: every layer is attention
        for i in places:
            if i < len(typed) and type(typed[i]) not in plain:
                raise PlanError(
                    f"{type(self.shell).__name__}'s layer {i} keeps a {type(typed[i]).__name__}, "
                    "not keys and values: generate() and seq_chunks carry the caches of "
                    "attention layers whose state is keys and values only"
                )

    def forward_cached(self, x: Tensor, cache: PlanCache, context: CacheContext) -> Any:
        """The new tokens (ids on the first stage, the stage before's hidden states on the
        others) through this stage with its cache: hidden states, or on the last stage the
        logits of each row's last token (with ``context.every_token``, a sub-sequence in
        training: the model's output of every token's logits, as ``forward`` returns it)."""
        shell = self.shell
        shell.training = self.training
        kwargs: dict[str, Any] = {
            "attention_mask": context.valid.long(),
            "position_ids": context.positions,
            self._cache_name: cache.cache,
            "use_cache": True,
        }
        if self.is_first:
            kwargs["input_ids"] = x
        else:
            kwargs["inputs_embeds"] = torch.zeros_like(x)
            assert self._hand_over is not None
            self._hand_over.received = x
        try:
            if self.is_last:
                if context.every_token:  # training on a sub-sequence: output as forward's
                    out = shell(**kwargs)
                    return type(out)(logits=out.logits)
                if "logits_to_keep" in inspect.signature(type(shell).forward).parameters:
                    kwargs["logits_to_keep"] = 1
                logits: Tensor = shell(**kwargs).logits
                return logits
            hidden: Tensor = shell.get_submodule(self.layout.base)(**kwargs).last_hidden_state
            return hidden
        finally:
            if self._hand_over is not None:
                self._hand_over.received = None

    @property
    def _cache_name(self) -> str:
        """What the base model calls its cache argument (``cache`` from transformers 5.x)."""
        base = self.shell.get_submodule(self.layout.base)
        params = inspect.signature(type(base).forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def generation_limits(self) -> tuple[int | None, int | None]:
        """The vocabulary and the longest sequence of the model's config."""
        config = self.shell.config
        vocab = getattr(config, "vocab_size", None)
        names = ("max_position_embeddings", "n_positions")
        context = next(
            (getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None
        )
        return (vocab if isinstance(vocab, int) else None), context

    def extra_repr(self) -> str:
        return f"stage={self.index} of {self.n_stages}, layers=[{self.start}, {self.stop})"


class HeldLayer:
    """One of a stage's decoder layers in its cache, as ``gpipe.runtime.kv_cache`` moves rows:
    keys and values ``[rows, heads, columns, head_dim]``, None until the layer has any."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    @property
    def keys(self) -> Tensor | None:
        return self.layer.keys if self.layer.is_initialized else None

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        self._set("keys", value)

    @property
    def values(self) -> Tensor | None:
        return self.layer.values if self.layer.is_initialized else None

    @values.setter
    def values(self, value: Tensor | None) -> None:
        self._set("values", value)

    def carry(self) -> list[Tensor]:
        """The keys and values of every token so far, for the next sub-sequence in training
        (the model's cache joins them)."""
        keys, values = self.keys, self.values
        return [] if keys is None or values is None else [keys, values]

    def take_carry(self, carried: Sequence[Tensor]) -> None:
        self.keys, self.values = carried

    def _set(self, name: str, value: Tensor | None) -> None:
        setattr(self.layer, name, value)
        if value is not None:  # as the layer's own first update would have left it
            self.layer.is_initialized, self.layer.device = True, value.device


@dataclass
class PlanCache:
    """A stage's cache for one group: the model's ``DynamicCache`` and this stage's layers."""

    cache: Any
    held: list[HeldLayer]

    def kv_layers(self) -> list[HeldLayer]:
        return self.held
