"""Hugging Face models kept whole in a LightningModule train on a pipeline.

``forward`` calls ``self.model(input_ids=..., attention_mask=..., labels=...)``; the layer
list is the model's embedding, one layer per block and the final norm with the head
(``profile/hf_layers.py``). Tiny models from configs train 3 AdamW steps in float64 on a
2-stage plan whose cut the planner picks or on a named cut, on a 2x2 hybrid plan, with
recomputation and with out-of-order backprop on and off; every parameter must be within
a relative 1e-10 of plain Lightning on one process (with dropout, of the same pipeline
without recomputation).
"""
from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import hf_toys  # noqa: E402
from lightning_toys import states_under_plan_and_plain  # noqa: E402
from lightning_dapple.errors import DappleConfigError  # noqa: E402
from lightning_dapple.strategy.module_adapter import find_layers  # noqa: E402

TWO_STAGES = {"global_batch_size": hf_toys.ROWS, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}


def _relative_difference(ours: dict, plain: dict) -> float:
    scale = max(float(v.abs().max()) for v in plain.values() if v.is_floating_point())
    return max(float((ours[k] - v).abs().max()) for k, v in plain.items() if v.is_floating_point()) / scale


def _samples(batch: dict) -> list[tuple]:
    args = lambda rows: tuple(batch[k][:rows] for k in ("input_ids", "attention_mask", "labels"))  # noqa: E731
    return [args(1), args(2)]


def _layers(model) -> list[str]:
    return find_layers(model, "layers", lambda: _samples(hf_toys.lm_batches(1)[0])).describe()


def test_llama_gets_one_layer_per_decoder_block() -> None:
    lines = _layers(hf_toys.LitLM(hf_toys.llama_config()))
    assert lines[0] == "layer list traced from LitLM.forward (6 layers):"
    assert [line.split()[1] for line in lines[1:7]] == [
        "model.model.embed_tokens", *(f"model.model.layers.{i}" for i in range(4)), "model.model.norm,",
    ]
    assert lines[7:] == []


@pytest.mark.timeout(120)
def test_llama_with_padding_and_labels_trains_like_plain_lightning(tmp_path) -> None:
    make = functools.partial(hf_toys.LitLM, hf_toys.llama_config())
    ours, plain = states_under_plan_and_plain(tmp_path, make, hf_toys.lm_batches(), TWO_STAGES)
    difference = _relative_difference(ours, plain)
    print(f"llama: max relative difference {difference:.3g}")
    assert difference <= 1e-10
    assert not torch.equal(plain["model.lm_head.weight"], make().double().state_dict()["model.lm_head.weight"])  # it trained


@pytest.mark.timeout(120)
def test_gpt2_with_tied_embeddings_and_labels_trains_like_plain_lightning(tmp_path) -> None:
    """The head's weight is wte's (tied), on the other stage than the embedding: each stage
    keeps a copy and their gradients are summed."""
    make = functools.partial(hf_toys.LitLM, hf_toys.gpt2_config())
    model = make()
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    plan = {**TWO_STAGES, "stages": [{"layers": [0, 3], "devices": [0]}, {"layers": [3, 6], "devices": [1]}]}
    ours, plain = states_under_plan_and_plain(tmp_path, make, hf_toys.lm_batches(), plan)
    difference = _relative_difference(ours, plain)
    print(f"gpt2: max relative difference {difference:.3g}")
    assert difference <= 1e-10
    assert torch.equal(ours["model.lm_head.weight"], ours["model.transformer.wte.weight"])


@pytest.mark.timeout(120)
def test_bert_sequence_classification_with_mask_and_labels_trains_like_plain_lightning(tmp_path) -> None:
    """HF's loss picks single-label classification from labels.dtype, on the last stage."""
    make = functools.partial(hf_toys.LitClassifier, hf_toys.bert_config())
    ours, plain = states_under_plan_and_plain(tmp_path, make, hf_toys.classification_batches(), TWO_STAGES)
    difference = _relative_difference(ours, plain)
    print(f"bert: max relative difference {difference:.3g}")
    assert difference <= 1e-10


def _fit_under(tmp_path, make, data, strategy, devices: int, callbacks=()) -> dict:
    """The state dict after fitting ``make()`` (float64) for 3 steps under ``strategy``."""
    from lightning.pytorch import Trainer

    model = make().double()
    Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=list(callbacks),
    ).fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return model.state_dict()


@pytest.mark.timeout(150)
def test_llama_with_padding_on_a_hybrid_plan_with_recomputation_trains_like_plain_lightning(tmp_path) -> None:
    """2 stages x 2 replicas (4 processes), every stage recomputing its forward before its
    backward (the plan's per-stage ``recompute``), out-of-order backprop off; the replicas'
    gradients are averaged over 8 padded rows."""
    from lightning_dapple.strategy import DappleStrategy

    make = functools.partial(hf_toys.LitLM, hf_toys.llama_config())
    data = hf_toys.lm_batches(rows=8)
    plan = {
        "global_batch_size": 8, "micro_batches": 2,
        "stages": [{"layers": [0, 3], "devices": [0, 1], "recompute": "always"}, {"layers": [3, 6], "devices": [2, 3], "recompute": "always"}],
    }
    strategy = DappleStrategy(plan=plan, ooo=False, timeout_s=60, start_method="spawn")
    ours = _fit_under(tmp_path, make, data, strategy, 4, [hf_toys.RecomputeCounter(str(tmp_path))])
    plain = _fit_under(tmp_path, make, data, "auto", 1)
    difference = _relative_difference(ours, plain)
    print(f"llama 2x2 hybrid, recompute: max relative difference {difference:.3g}")
    assert difference <= 1e-10
    assert [json.loads((tmp_path / f"recomputed_rank{r}.json").read_text()) for r in range(4)] == [[2, 2, 2]] * 4  # both micro-batches, every step
    assert not torch.equal(plain["model.lm_head.weight"], make().double().state_dict()["model.lm_head.weight"])  # it trained


@pytest.mark.timeout(150)
def test_gpt2_with_out_of_order_backprop_and_recomputation_trains_like_plain_lightning(tmp_path) -> None:
    """ooo=True (weight gradients deferred) and recompute="always" on a 2-stage plan whose
    cut the planner picks; GPT-2's tied head and wte on different stages."""
    from lightning_dapple.strategy import DappleStrategy

    make = functools.partial(hf_toys.LitLM, hf_toys.gpt2_config())
    data = hf_toys.lm_batches()
    strategy = DappleStrategy(plan=TWO_STAGES, ooo=True, recompute="always", timeout_s=60, start_method="spawn")
    ours = _fit_under(tmp_path, make, data, strategy, 2, [hf_toys.RecomputeCounter(str(tmp_path))])
    plain = _fit_under(tmp_path, make, data, "auto", 1)
    difference = _relative_difference(ours, plain)
    print(f"gpt2 ooo + recompute: max relative difference {difference:.3g}")
    assert difference <= 1e-10
    assert [json.loads((tmp_path / f"recomputed_rank{r}.json").read_text()) for r in range(2)] == [[2, 2, 2]] * 2
    assert torch.equal(ours["model.lm_head.weight"], ours["model.transformer.wte.weight"])


@pytest.mark.timeout(150)
def test_gpt2_with_dropout_recomputes_the_same_dropout_masks(tmp_path) -> None:
    """Dropout 0.1 (embeddings, attention, residuals): recomputation replays each
    micro-batch's dropout draws, so the pipeline with recompute="always" trains exactly like
    the same pipeline without recomputation. (Plain Lightning is no reference here: it
    draws one mask for the whole batch, the pipeline one per micro-batch, so their
    parameters differ by a few percent after 3 steps.)"""
    from lightning_dapple.strategy import DappleStrategy

    make = functools.partial(hf_toys.LitLM, hf_toys.gpt2_config(dropout=0.1))
    data = hf_toys.lm_batches()
    plan = {**TWO_STAGES, "stages": [{"layers": [0, 3], "devices": [0]}, {"layers": [3, 6], "devices": [1]}]}
    counter = hf_toys.RecomputeCounter(str(tmp_path))
    again = _fit_under(tmp_path, make, data, DappleStrategy(plan=plan, ooo=True, recompute="always", timeout_s=60, start_method="spawn"), 2, [counter])
    assert [json.loads((tmp_path / f"recomputed_rank{r}.json").read_text()) for r in range(2)] == [[2, 2, 2]] * 2
    kept = _fit_under(tmp_path, make, data, DappleStrategy(plan=plan, ooo=True, recompute="never", timeout_s=60, start_method="spawn"), 2)
    assert all(torch.equal(again[k], v) for k, v in kept.items())
    assert not torch.equal(kept["model.lm_head.weight"], make().double().state_dict()["model.lm_head.weight"])  # it trained


def _chain(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _attention(config, implementation: str):
    config._attn_implementation = implementation
    return config


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(
    ("make", "batch"),
    [
        (lambda a: hf_toys.LitLM(_attention(hf_toys.llama_config(), a)), hf_toys.lm_batches),
        (lambda a: hf_toys.LitLM(_attention(hf_toys.gpt2_config(), a)), hf_toys.lm_batches),
        (lambda a: hf_toys.LitClassifier(_attention(hf_toys.bert_config(), a)), hf_toys.classification_batches),
        (lambda a: hf_toys.LitLM(_attention(hf_toys.decoder_config("mistral"), a)), hf_toys.lm_batches),
        (lambda a: hf_toys.LitLM(_attention(hf_toys.decoder_config("qwen2"), a)), hf_toys.lm_batches),
        (lambda a: hf_toys.LitLM(_attention(hf_toys.decoder_config("qwen3"), a)), hf_toys.lm_batches),
    ],
    ids=["llama", "gpt2", "bert", "mistral", "qwen2", "qwen3"],
)
def test_the_layers_in_order_compute_the_models_loss_and_gradients(make, batch, attention) -> None:
    """In one process, float64, with the sdpa and the eager attention: the layer list
    applied in order gives Hugging Face's own output (loss, logits) and the same gradients
    as calling the model."""
    torch.set_num_threads(1)
    model = make(attention).double()
    assert model.model.config._attn_implementation == attention
    data = batch(1)[0]
    args = tuple(data[k] for k in ("input_ids", "attention_mask", "labels"))
    layers = find_layers(model, "layers", lambda: [tuple(a[:1] for a in args), tuple(a[:2] for a in args)])
    assert len(layers) == 6
    expected = model(*args)
    expected_grads = torch.autograd.grad(expected.loss, list(model.parameters()))
    actual = _chain(layers, args)
    # the model's own call also returns its key/value cache (use_cache defaults to True); the layers keep none
    assert type(actual) is type(expected) and list(actual.keys()) == [k for k in expected.keys() if k != "cache"] == ["loss", "logits"]
    grads = torch.autograd.grad(actual.loss, list(model.parameters()))
    assert torch.equal(actual.logits, expected.logits) and torch.equal(actual.loss, expected.loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_hugging_faces_own_checkpointing_is_refused_naming_the_strategys_recompute() -> None:
    """gradient_checkpointing_enable() inside the block layers would fail under out-of-order
    backprop and recompute every block twice beside the strategy's recomputation: refused,
    with the fix, before anything runs."""
    torch.set_num_threads(1)
    model = hf_toys.LitLM(hf_toys.llama_config()).double()
    model.model.gradient_checkpointing_enable()
    data = hf_toys.lm_batches(1)[0]
    args = tuple(data[k] for k in ("input_ids", "attention_mask", "labels"))
    with pytest.raises(DappleConfigError, match=r"self.model.gradient_checkpointing_enable\(\): .*Fix: call self.model.gradient_checkpointing_disable\(\) and pass DappleStrategy\(recompute='always'\)"):
        find_layers(model, "layers", lambda: [tuple(a[:1] for a in args), tuple(a[:2] for a in args)])
    model.model.gradient_checkpointing_disable()
    assert len(find_layers(model, "layers", lambda: [tuple(a[:1] for a in args), tuple(a[:2] for a in args)])) == 6


def test_a_model_type_without_an_entry_is_refused_with_one_line() -> None:
    from transformers import OPTConfig

    from lightning_dapple.errors import DappleConfigError

    config = OPTConfig(vocab_size=hf_toys.VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=16)
    words = (
        r"^LitLM.forward: calls the Hugging Face model self.model \(OPTForCausalLM, model_type 'opt'\), whose blocks lightning_dapple "
        r"cannot yet cut into pipeline layers \(supported model types: bert, gpt2, llama, mistral, qwen2, qwen3\)\. "
        r"Fix: give the layer list by hand: an nn.Sequential"
    )
    with pytest.raises(DappleConfigError, match=words) as raised:
        _layers(hf_toys.LitLM(config))
    assert "\n" not in str(raised.value)


def test_a_token_mean_over_uneven_padding_is_refused_before_training(tmp_path) -> None:
    """-100 only on each row's padding: HF's token mean divides by counts that differ
    between micro-batches, so the first step stops before any parameter changes."""
    from lightning.pytorch import Trainer

    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.strategy import DappleStrategy

    batches = hf_toys.lm_batches(2)
    for batch in batches:
        batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    model = hf_toys.LitLM(hf_toys.llama_config()).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = {"global_batch_size": hf_toys.ROWS, "micro_batches": 2, "stages": [{"devices": [0]}]}
    trainer = Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=30), accelerator="cpu", devices=1, precision="64-true", max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    with pytest.raises(DappleConfigError) as raised:
        trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    print(raised.value)
    assert "cross_entropy averages over the targets other than ignore_index=-100" in str(raised.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_per_sequence_mean_over_uneven_padding_trains_like_plain_lightning(tmp_path) -> None:
    """The fix the refusal above names: each sequence's token mean, then the sequences'
    mean, computed in training_step from the logits (one process, M=2)."""
    batches = hf_toys.lm_batches(3)
    for batch in batches:
        batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    plan = {"global_batch_size": hf_toys.ROWS, "micro_batches": 2, "stages": [{"devices": [0]}]}
    from lightning_dapple.strategy import DappleStrategy

    make = functools.partial(hf_toys.LitLMPerSequenceMean, hf_toys.llama_config())
    ours = _fit_under(tmp_path, make, batches, DappleStrategy(plan=plan, timeout_s=30), 1)
    plain = _fit_under(tmp_path, make, batches, "auto", 1)
    difference = _relative_difference(ours, plain)
    print(f"per-sequence mean: max relative difference {difference:.3g}")
    assert difference <= 1e-10


@pytest.mark.timeout(150)
def test_from_pretrained_fit_save_pretrained_round_trip(tmp_path) -> None:
    """save_pretrained -> from_pretrained -> fit on 2 stages -> model.model.save_pretrained:
    rank 0 gets the whole trained model back (the tie between GPT-2's head and wte too),
    and what it saves loads into what plain Lightning trained."""
    from lightning.pytorch import Trainer
    from transformers import AutoModelForCausalLM

    from lightning_dapple.strategy import DappleStrategy

    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(hf_toys.gpt2_config()).save_pretrained(tmp_path / "start")

    def fit(strategy, devices: int):
        model = hf_toys.LitLM(directory=str(tmp_path / "start")).double()
        Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        ).fit(model, torch.utils.data.DataLoader(hf_toys.lm_batches(), batch_size=None))
        return model

    ours = fit(DappleStrategy(plan=TWO_STAGES, timeout_s=60, start_method="spawn"), 2)
    assert ours.model.lm_head.weight is ours.model.transformer.wte.weight
    ours.model.save_pretrained(tmp_path / "trained")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float64)
    plain = fit("auto", 1).model.state_dict()
    assert set(reloaded.state_dict()) == set(plain)
    difference = _relative_difference(reloaded.state_dict(), plain)
    print(f"round trip: max relative difference {difference:.3g}")
    assert difference <= 1e-10


def test_glue_after_the_call_runs_on_the_last_layer() -> None:
    torch.set_num_threads(1)
    model = hf_toys.LitLMReturningTheLoss(hf_toys.gpt2_config()).double()
    data = hf_toys.lm_batches(1)[0]
    args = tuple(data[k] for k in ("input_ids", "attention_mask", "labels"))
    layers = find_layers(model, "layers", lambda: [tuple(a[:1] for a in args), tuple(a[:2] for a in args)])
    loss = _chain(layers, args)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and torch.equal(loss, model(*args))


def test_arguments_computed_in_forward_are_refused_with_the_fix() -> None:
    from lightning_dapple.errors import DappleConfigError

    words = r"LitLMComputingItsMask.forward: computes the argument attention_mask= of model\(...\) itself.*Fix: give the layer list by hand"
    with pytest.raises(DappleConfigError, match=words):
        _layers(hf_toys.LitLMComputingItsMask(hf_toys.llama_config()))
