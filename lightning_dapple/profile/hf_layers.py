"""The layer list of a Hugging Face model that ``forward`` calls whole: one layer per block.

A LightningModule written as people write them holds a ``transformers`` model and calls
it: ``forward(input_ids, attention_mask=None, labels=None): return self.model(input_ids=...,
attention_mask=..., labels=...)``. Traced with child modules as leaves
(``profile/trace.py``) that is one call, so there would be no pipeline; traced through,
``torch.fx`` stops in Hugging Face's mask-building code. The way ``torchtitan`` and vLLM
pipeline such models is taken instead: Hugging Face's own modules are called the way its own
``forward`` calls them, cut at the block list.

* **Layer 0** binds the call's arguments by name, as ``self.model(...)`` would, and runs
  the base model's embedding part (Llama's ``embed_tokens``; GPT-2's ``wte`` + ``wpe`` and
  dropout; BERT's ``embeddings``).
* **One layer per block** of the base model's ``nn.ModuleList`` (``layers``, ``h``,
  ``encoder.layer``). Each builds the attention mask from the 2-D ``attention_mask`` with
  ``transformers.masking_utils`` (what the base model's ``forward`` does once) and, for
  rotary models, the rotary table from the position ids, then calls the block with the
  keywords the base model passes it, ``use_cache=False``.
* **The last layer** runs what the base model does after its blocks (final norm, BERT's
  pooler) and then the head model's own ``forward`` (``type(model).forward``) on a view of
  the model whose base model answers with that output: the logits, ``labels`` and Hugging
  Face's own loss (``loss_function``, BERT's ``problem_type`` branch on ``labels.dtype``)
  are computed by Hugging Face's code, and the user's glue after the call (``.loss``)
  follows.

Between layers travel, as one tuple of batch-first tensors, the hidden states and every
tensor argument of the call (``input_ids``, ``attention_mask``, ``position_ids``,
``token_type_ids``, ``labels``: integers, a fraction of the hidden states' bytes), so each
stage rebuilds masks and rotary tables itself (per micro-batch and block: one (B, 1, T, T)
mask, or none where sdpa's causal path needs none, and one (B, T, head_dim) table).

What happens around the blocks differs between architectures: the small table ``_FAMILIES``
says it per ``config.model_type`` (llama, mistral, qwen2, qwen3: the Llama shape, with
sliding-window masks where the config asks; gpt2; bert); a model type not in it is refused
with one line. Any head on those base models works (``*ForCausalLM``,
``*ForSequenceClassification``, ...): its ``forward`` is Hugging Face's. The layers never
keep a key/value cache (``use_cache=False`` in every block; the model's config is left as
it is, and setup's check that ``forward`` equals the layer list leaves a returned cache
out). ``transformers`` is never imported here: a model object of it means
it is loaded already; written against transformers 5.24 (``masking_utils`` with ``cache=``).
Hugging Face's activation checkpointing (``gradient_checkpointing_enable()``) is refused
with the fix, the strategy's ``recompute``: inside a block layer its replay fails under
out-of-order backprop, and beside the strategy's recomputation it would recompute every
block a second time.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.profile.trace import _trace_once, forward_signature

__all__ = ["HF_LAYERS_FIX", "HFBlock", "HFEmbedding", "HFHead", "hf_layers", "is_hf_layer_list", "is_hf_model"]

HF_LAYERS_FIX = (
    "give the layer list by hand: an nn.Sequential of small modules (the embedding, each block of the model's "
    "block list, the final norm with the head) that forward applies in order, passed as DappleStrategy(layers='...') "
    "(docs/huggingface.md: 'What is refused')"
)


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (without importing it)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def is_hf_layer_list(layers: Sequence[nn.Module]) -> bool:
    """Whether ``layers`` is a layer list made here (its layer 0 is an ``HFEmbedding``)."""
    return len(layers) > 0 and isinstance(layers[0], HFEmbedding)


def _masks() -> Any:
    return importlib.import_module("transformers.masking_utils")


def _outputs() -> Any:
    return importlib.import_module("transformers.modeling_outputs")


def _positions(kw: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
    """The position ids as the base model makes them when none are given (no cache)."""
    given = kw.get("position_ids")
    return given if given is not None else torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


# --------------------------------------------------------------------------- the per-architecture table


def _llama_embed(parts: nn.ModuleDict, kw: dict[str, Any]) -> torch.Tensor:
    return parts["embed_tokens"](kw["input_ids"])


def _mask_maker(config: Any, index: int) -> Callable[..., Any]:
    """The mask function the base model uses for block ``index``: causal, or sliding-window
    causal (Mistral with ``sliding_window``; Qwen2/3 blocks whose ``layer_types`` say so)."""
    masks = _masks()
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "mistral":
        sliding = getattr(config, "sliding_window", None) is not None
    else:
        sliding = bool(layer_types) and layer_types[index] == "sliding_attention"
    return masks.create_sliding_window_causal_mask if sliding else masks.create_causal_mask


def _llama_block(block: nn.Module, helpers: nn.ModuleDict, config: Any, hidden: torch.Tensor, kw: dict[str, Any], index: int) -> torch.Tensor:
    position_ids = _positions(kw, hidden)
    mask = _mask_maker(config, index)(
        config=config, inputs_embeds=hidden, attention_mask=kw.get("attention_mask"), cache=None, position_ids=position_ids
    )
    rotary = helpers["rotary_emb"](hidden, position_ids=position_ids)
    return block(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids, use_cache=False)


def _llama_finish(parts: nn.ModuleDict, hidden: torch.Tensor, kw: dict[str, Any]) -> Any:
    return _outputs().BaseModelOutputWithPast(last_hidden_state=parts["norm"](hidden))


def _gpt2_embed(parts: nn.ModuleDict, kw: dict[str, Any]) -> torch.Tensor:
    input_ids = kw["input_ids"]
    input_ids = input_ids.view(-1, input_ids.shape[-1])
    inputs_embeds = parts["wte"](input_ids)
    hidden = inputs_embeds + parts["wpe"](_positions(kw, inputs_embeds))
    if kw.get("token_type_ids") is not None:
        hidden = hidden + parts["wte"](kw["token_type_ids"].view(-1, input_ids.shape[-1]))
    return parts["drop"](hidden)


def _gpt2_block(block: nn.Module, helpers: nn.ModuleDict, config: Any, hidden: torch.Tensor, kw: dict[str, Any], index: int) -> torch.Tensor:
    attention_mask = kw.get("attention_mask")
    if attention_mask is not None and attention_mask.ndim < 4:
        attention_mask = attention_mask.view(hidden.shape[0], -1)
    position_ids = _positions(kw, hidden)
    mask = _masks().create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None, position_ids=position_ids)
    return block(hidden, attention_mask=mask, use_cache=False, position_ids=position_ids)


def _gpt2_finish(parts: nn.ModuleDict, hidden: torch.Tensor, kw: dict[str, Any]) -> Any:
    return _outputs().BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=parts["ln_f"](hidden))


def _bert_embed(parts: nn.ModuleDict, kw: dict[str, Any]) -> torch.Tensor:
    return parts["embeddings"](
        input_ids=kw["input_ids"], position_ids=kw.get("position_ids"), token_type_ids=kw.get("token_type_ids")
    )


def _bert_block(block: nn.Module, helpers: nn.ModuleDict, config: Any, hidden: torch.Tensor, kw: dict[str, Any], index: int) -> torch.Tensor:
    masks = _masks()
    if config.is_decoder:
        mask = masks.create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=kw.get("attention_mask"), cache=None)
    else:
        mask = masks.create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=kw.get("attention_mask"))
    return block(hidden, mask, position_ids=kw.get("position_ids"))


def _bert_finish(parts: nn.ModuleDict, hidden: torch.Tensor, kw: dict[str, Any]) -> Any:
    pooler = parts["pooler"] if "pooler" in parts else None
    return _outputs().BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=hidden, pooler_output=pooler(hidden) if pooler is not None else None
    )


@dataclass(frozen=True)
class _Family:
    """What one architecture's base model does around its block list: the base model's
    children used before the blocks (``front``), for every block (``helpers``) and after
    them (``back``), the block list's path, and the three steps."""

    front: tuple[str, ...]
    blocks: str
    helpers: tuple[str, ...]
    back: tuple[str, ...]
    embed: Callable[[nn.ModuleDict, dict[str, Any]], torch.Tensor]
    block: Callable[[nn.Module, nn.ModuleDict, Any, torch.Tensor, dict[str, Any], int], torch.Tensor]
    finish: Callable[[nn.ModuleDict, torch.Tensor, dict[str, Any]], Any]
    # the base model's call arguments this family handles (others must be None / default)
    arguments: tuple[str, ...]


_LLAMA = _Family(("embed_tokens",), "layers", ("rotary_emb",), ("norm",), _llama_embed, _llama_block, _llama_finish, ("input_ids", "attention_mask", "position_ids"))
_FAMILIES: dict[str, _Family] = {
    **{name: _LLAMA for name in ("llama", "mistral", "qwen2", "qwen3")},
    "gpt2": _Family(("wte", "wpe", "drop"), "h", (), ("ln_f",), _gpt2_embed, _gpt2_block, _gpt2_finish, ("input_ids", "attention_mask", "position_ids", "token_type_ids")),
    "bert": _Family(("embeddings",), "encoder.layer", (), ("pooler",), _bert_embed, _bert_block, _bert_finish, ("input_ids", "attention_mask", "position_ids", "token_type_ids")),
}
# arguments that may be given with these values only (the pipeline trains without a cache)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_cache": (None, False),
    "cache": (None,),
    "past_key_values": (None,),
    "inputs_embeds": (None,),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "return_dict": (None, True, False),
    "logits_to_keep": (0,),
    "encoder_hidden_states": (None,),
    "encoder_attention_mask": (None,),
}


# --------------------------------------------------------------------------- the call's arguments


@dataclass(frozen=True)
class _Call:
    """The arguments of ``self.<path>(...)`` by name: from forward's inputs (by index) or
    constants; ``carried`` are the tensor ones, which travel with the hidden states."""

    from_inputs: dict[str, int]
    constants: dict[str, Any]
    carried: tuple[str, ...]
    num_inputs: int

    def bind(self, x: Any) -> dict[str, Any]:
        """The tensor arguments from layer 0's input (forward's positional arguments)."""
        args = x if self.num_inputs > 1 else (x,)
        return {name: args[index] for name, index in self.from_inputs.items() if name in self.carried}

    def keywords(self, carried: dict[str, Any]) -> dict[str, Any]:
        return {**self.constants, **carried}


def _unpack(x: tuple, carried: tuple[str, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
    return x[0], dict(zip(carried, x[1:]))


def _pack(hidden: torch.Tensor, kw: dict[str, Any], carried: tuple[str, ...]) -> tuple:
    return (hidden, *(kw[name] for name in carried))


# --------------------------------------------------------------------------- the layers


class HFEmbedding(nn.Module):
    """Layer 0: the call's arguments bound by name, and the base model's embedding part."""

    def __init__(self, family: _Family, parts: dict[str, nn.Module], call: _Call) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self.family = family
        self.call = call

    def forward(self, x: Any) -> tuple:
        kw = self.call.bind(x)
        hidden = self.family.embed(self.parts, self.call.keywords(kw))
        return _pack(hidden, kw, self.call.carried)


class HFBlock(nn.Module):
    """One block of the base model's block list, with the mask (and rotary table) it needs."""

    def __init__(self, family: _Family, block: nn.Module, index: int, helpers: dict[str, nn.Module], config: Any, call: _Call) -> None:
        super().__init__()
        self.block = block
        self.index = index
        self.helpers = nn.ModuleDict(helpers)
        self.family = family
        self.config = config
        self.call = call

    def forward(self, x: tuple) -> tuple:
        hidden, kw = _unpack(x, self.call.carried)
        hidden = self.family.block(self.block, self.helpers, self.config, hidden, self.call.keywords(kw), self.index)
        return _pack(hidden, kw, self.call.carried)


class _HeadView:
    """The head model as its ``forward`` sees it, except that its base model answers with
    the output the last layer computed (nothing of the model is changed)."""

    def __init__(self, model: nn.Module, prefix: str, base_output: Any) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_base_output", base_output)

    def __getattr__(self, name: str) -> Any:
        if name == self._prefix:
            return lambda *args, **kwargs: self._base_output
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._model, name, value)


class HFHead(nn.Module):
    """The last layer: what the base model does after its blocks, the head model's own
    ``forward`` from there (logits, loss), and forward's glue after the call."""

    def __init__(self, family: _Family, back: dict[str, nn.Module], head: dict[str, nn.Module], model: nn.Module, call: _Call, tail: fx.GraphModule | None) -> None:
        super().__init__()
        self.back = nn.ModuleDict(back)
        self.head = nn.ModuleDict(head)
        self.family = family
        self.call = call
        self.tail = tail
        self._model = weakref.ref(model)  # the whole model is not this layer's: no child

    def forward(self, x: tuple) -> Any:
        hidden, kw = _unpack(x, self.call.carried)
        keywords = self.call.keywords(kw)
        base_output = self.family.finish(self.back, hidden, keywords)
        model = self._model()
        assert model is not None, "the Hugging Face model this layer list was made from is gone"
        if model.base_model is model:  # a base model without a head (AutoModel)
            output = base_output if keywords.get("return_dict", True) is not False else base_output.to_tuple()
        else:
            output = type(model).forward(_HeadView(model, model.base_model_prefix, base_output), **keywords)
        return self.tail(output) if self.tail is not None else output


# --------------------------------------------------------------------------- finding the call


def _hf_call(program: fx.GraphModule) -> fx.Node | None:
    """The one call of a Hugging Face model in the traced forward, or None."""
    calls = [node for node in program.graph.nodes if node.op == "call_module"]
    if len(calls) != 1 or not is_hf_model(program.get_submodule(str(calls[0].target))):
        return None
    return calls[0]


def _refuse(owner: str, problem: str) -> DappleConfigError:
    return DappleConfigError(f"{owner}.forward", problem, HF_LAYERS_FIX)


def _bound_call(owner: str, node: fx.Node, model: nn.Module) -> dict[str, Any]:
    """The call's arguments by the model's parameter names."""
    try:
        bound = inspect.signature(type(model).forward).bind(None, *node.args, **node.kwargs)
    except TypeError as exc:
        raise _refuse(owner, f"calls {node.target}(...) with arguments its forward does not take: {exc}") from None
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(inspect.signature(type(model).forward).parameters)))
    for name, value in inspect.signature(type(model).forward).parameters.items():
        if value.kind is value.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def _call_plan(owner: str, node: fx.Node, model: nn.Module, family: _Family, samples: Sequence[tuple], head_only: set[str]) -> _Call:
    """Which of the call's arguments come from forward's inputs, which are constants, and
    which tensors travel (refusing what the pipeline cannot run)."""
    placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    from_inputs: dict[str, int] = {}
    constants: dict[str, Any] = {}
    for name, value in _bound_call(owner, node, model).items():
        if isinstance(value, fx.Node):
            if value.op != "placeholder":
                raise _refuse(owner, f"computes the argument {name}= of {node.target}(...) itself; the layer list follows only "
                              "forward's own arguments handed to the Hugging Face model")
            index = placeholders.index(value)
            if all(sample[index] is None for sample in samples):
                constants[name] = None
                continue
            from_inputs[name] = index
        else:
            constants[name] = value
    carried = []
    for name, index in from_inputs.items():
        values = [sample[index] for sample in samples]
        if all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values):
            carried.append(name)
        elif all(not isinstance(v, torch.Tensor) for v in values):
            constants[name] = values[0]
        else:
            raise _refuse(owner, f"passes {name}= to {node.target}(...) as a tensor without a batch dimension")
    for name, value in constants.items():
        allowed = _NEUTRAL.get(name)
        if name in family.arguments or name in head_only or (allowed is not None and any(value is a or (type(value) is type(a) and value == a) for a in allowed)):
            continue
        raise _refuse(owner, f"passes {name}={value!r} to {node.target}(...), which the pipeline of {type(model).__name__} does not run "
                      "(it trains without a cache, on input_ids)")
    if "input_ids" not in carried:
        raise _refuse(owner, f"calls {node.target}(...) without input_ids (inputs_embeds are not supported)")
    return _Call(from_inputs, constants, tuple(carried), len(placeholders))


def _tail(program: fx.GraphModule, call: fx.Node, owner: str) -> fx.GraphModule | None:
    """Forward's glue after the call (``.loss``, ``.logits``), as a program on its output."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    if output.args[0] is call:
        return None
    after = [n for n in program.graph.nodes if n.op not in ("placeholder", "output") and n is not call]
    before_call = [n for n in after if n.op != "get_attr" and list(program.graph.nodes).index(n) < list(program.graph.nodes).index(call)]
    if before_call:
        raise _refuse(owner, f"does more than call {call.target}(...) with its own arguments")
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {call: graph.placeholder("output")}
    for n in after:
        try:
            env[n] = graph.node_copy(n, env.__getitem__)
        except KeyError:
            raise _refuse(owner, f"uses its inputs again after calling {call.target}(...)") from None
    graph.output(fx.map_arg(output.args[0], env.__getitem__))
    return fx.GraphModule(program, graph, class_name="AfterHFCall")


def _family_of(owner: str, path: str, model: nn.Module) -> _Family:
    model_type = getattr(model.config, "model_type", None)
    family = _FAMILIES.get(str(model_type))
    if family is None:
        raise DappleConfigError(
            f"{owner}.forward",
            f"calls the Hugging Face model self.{path} ({type(model).__name__}, model_type '{model_type}'), whose blocks lightning_dapple "
            f"cannot yet cut into pipeline layers (supported model types: {', '.join(sorted(_FAMILIES))})",
            HF_LAYERS_FIX,
        )
    base = model.base_model
    expected = {*family.front, family.blocks.split(".")[0], *family.helpers, *family.back}
    extra = [name for name, child in base.named_children() if name not in expected and any(True for _ in child.parameters())]
    if extra or getattr(model.config, "add_cross_attention", False):
        raise DappleConfigError(
            f"{owner}.forward",
            f"calls self.{path} ({type(model).__name__}), whose base model holds parts the {model_type} layer list does not run "
            f"({', '.join(extra) or 'cross-attention'})",
            HF_LAYERS_FIX,
        )
    return family


def _head_parameters(model: nn.Module) -> set[str]:
    """The head model's own forward parameters (``labels``), which only the last layer reads."""
    if model.base_model is model:
        return set()
    base = set(forward_signature(model.base_model).parameters)
    return {name for name in forward_signature(model).parameters if name not in base}


def hf_layers(module: nn.Module, samples: Sequence[tuple], make_list: Callable[..., nn.ModuleList]) -> nn.ModuleList | None:
    """The layer list of a module whose ``forward`` calls one Hugging Face model with its
    own arguments (module docstring), built by ``make_list(layers, calls, source,
    inputs, notes)``; None when ``forward`` is not such a call."""
    if "transformers.modeling_utils" not in sys.modules:
        return None
    try:
        program = _trace_once(module, len(samples[0]), set())
    except Exception:
        return None
    call = _hf_call(program)
    if call is None:
        return None
    owner, path = type(module).__name__, str(call.target)
    model = program.get_submodule(path)
    if getattr(model, "is_gradient_checkpointing", False):
        raise DappleConfigError(
            f"self.{path}.gradient_checkpointing_enable()",
            "checkpoints inside every block, which the pipeline's split backward (out-of-order backprop) cannot replay "
            "and which would recompute every block a second time beside the strategy's own recomputation",
            f"call self.{path}.gradient_checkpointing_disable() and pass DappleStrategy(recompute='always') (or "
            "'except_last'): the strategy replays each stage's forward before its backward, with the same dropout draws",
        )
    family = _family_of(owner, path, model)
    plan = _call_plan(owner, call, model, family, samples, _head_parameters(model))
    tail = _tail(program, call, owner)
    notes: list[str] = []
    inputs = [str(n.target) for n in program.graph.nodes if n.op == "placeholder"]
    return _assemble(module, model, path, family, plan, tail, inputs, notes, make_list)


def _assemble(
    module: nn.Module, model: nn.Module, path: str, family: _Family, plan: _Call, tail: fx.GraphModule | None, inputs: list[str], notes: list[str],
    make_list: Callable[..., nn.ModuleList],
) -> nn.ModuleList:
    base = model.base_model
    base_path = path if base is model else f"{path}.{model.base_model_prefix}"
    blocks = base.get_submodule(family.blocks)
    front = {name: getattr(base, name) for name in family.front}
    helpers = {name: getattr(base, name) for name in family.helpers}
    back = {name: getattr(base, name) for name in family.back if getattr(base, name, None) is not None}
    head = {name: child for name, child in model.named_children() if child is not base}
    layers: list[nn.Module] = [HFEmbedding(family, front, plan)]
    calls: list[list[str]] = [[f"{base_path}.{name}" for name in front]]
    for index, block in enumerate(blocks):
        layers.append(HFBlock(family, block, index, helpers, base.config, plan))
        calls.append([f"{base_path}.{family.blocks}.{index}"])
    layers.append(HFHead(family, back, head, model, plan, tail))
    calls.append([f"{base_path}.{name}" for name in back] + [f"{path}.{name}" for name in head])
    return make_list(layers, calls, type(module).__name__, inputs, notes)
