"""Hugging Face models built on the meta device, in one process: their own initialisation
replayed per stage, a stage's weights read from a ``save_pretrained`` directory (only its
own keys), and ``plan="auto"``'s profile taken one layer real at a time.

The Trainer-level runs on two processes are in ``test_hf_meta_training.py``.
"""
from __future__ import annotations

import pickle

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hf_toys  # noqa: E402
from lightning_dapple.errors import DappleConfigError  # noqa: E402
from lightning_dapple.profile.profiler import profile_layers  # noqa: E402
from lightning_dapple.strategy.hf_weights import pretrained_weights  # noqa: E402
from lightning_dapple.strategy.meta_build import MetaBuild  # noqa: E402
from lightning_dapple.strategy.meta_profile import profile_one_layer_at_a_time  # noqa: E402
from lightning_dapple.strategy.module_adapter import find_layers  # noqa: E402


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, ties and non-persistent buffers included."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def _on_meta(make) -> tuple[MetaBuild, nn.Module]:
    build = MetaBuild()
    with build.recording():
        model = make()
    build.finish(model)
    assert build.problems == []
    return build, model


def _layers(model: nn.Module) -> nn.Module:
    data = hf_toys.lm_batches(1)[0]
    args = tuple(data[k] for k in ("input_ids", "attention_mask", "labels"))
    return find_layers(model, "layers", lambda: [tuple(a[:1] for a in args), tuple(a[:2] for a in args)])


def _tensors_of(layers, indices) -> set[int]:
    return {id(t) for i in indices for t in (*layers[i].parameters(), *layers[i].buffers())}


CONFIGS = {
    "llama": hf_toys.llama_config,
    "gpt2": hf_toys.gpt2_config,
    "bert": hf_toys.bert_config,
    **{name: (lambda name=name: hf_toys.decoder_config(name)) for name in ("mistral", "qwen2", "qwen3")},
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_hugging_face_model_built_on_meta_replays_its_own_initialisation(family: str) -> None:
    """from_config on the meta device: Hugging Face's _init_weights runs on the meta
    tensors and is recorded (told the CPU when it asks where modules are made), so the
    replay equals the CPU build under the same seed, the rotary tables (non-persistent
    buffers) included, and the generator ends where the CPU build leaves it."""
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModel if family == "bert" else AutoModelForCausalLM
    torch.manual_seed(5)
    plain = auto.from_config(CONFIGS[family]())
    after_plain = torch.rand(3)
    torch.manual_seed(5)
    build, meta = _on_meta(lambda: auto.from_config(CONFIGS[family]()))
    assert torch.equal(torch.rand(3), after_plain)
    build.materialize(meta, lambda tensor: True)
    expected, actual = _state(plain), _state(meta)
    assert set(expected) == set(actual)
    for name, value in expected.items():
        assert torch.equal(value, actual[name]), name
    if family == "gpt2":
        assert meta.lm_head.weight is meta.transformer.wte.weight  # the tie stays one parameter


def test_the_record_travels_with_the_model_in_one_pickle() -> None:
    """The spawn launcher sends the strategy (holding the record) and the module to the
    ranks in one pickle; the record finds the module's tensors again there."""
    torch.manual_seed(5)
    plain = hf_toys.LitLM(hf_toys.llama_config())
    torch.manual_seed(5)
    build = MetaBuild()
    with build.recording():
        meta = hf_toys.LitLM(hf_toys.llama_config())
    build, meta = pickle.loads(pickle.dumps((build, meta)))
    build.finish(meta)
    assert build.problems == []
    build.materialize(meta, lambda tensor: True)
    assert all(torch.equal(value, _state(meta)[name]) for name, value in _state(plain).items())


@pytest.fixture(scope="module")
def llama_directory(tmp_path_factory):
    """A tiny Llama saved in shards (model.safetensors.index.json), as large models are."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(hf_toys.llama_config()).save_pretrained(directory, max_shard_size="4KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


@pytest.fixture(scope="module")
def gpt2_directory(tmp_path_factory):
    """A tiny GPT-2 in one file; its lm_head is tied to wte and stored once."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(12)
    AutoModelForCausalLM.from_config(hf_toys.gpt2_config()).save_pretrained(directory)
    assert (directory / "model.safetensors").is_file()
    return directory


def _stage_from(directory, indices):
    """A LitLM built on the meta device whose layers ``indices`` are made from
    ``directory``; returns the module, its layer list and the keys read."""
    from transformers import AutoConfig

    build, module = _on_meta(lambda: hf_toys.LitLM(AutoConfig.from_pretrained(directory)))
    layers = _layers(module)
    weights = pretrained_weights(module, directory, built_on_meta=True)
    mine = _tensors_of(layers, indices)
    build.materialize(module, lambda tensor: id(tensor) in mine, weights)
    return module, layers, weights.read_keys


@pytest.mark.parametrize(("family", "stages"), [("llama", [[0, 3], [3, 6]]), ("gpt2", [[0, 2], [2, 6]])])
def test_each_stage_reads_only_its_own_keys_and_gets_from_pretrained_values(family, stages, llama_directory, gpt2_directory) -> None:
    """Each stage reads exactly the stored keys of its own tensors (a shard index for the
    Llama, one file for GPT-2, whose lm_head is the stored wte): the stages read the
    directory between them once, and every tensor a stage makes, the rotary tables too,
    equals from_pretrained's; the other stages' tensors stay on the meta device."""
    directory = llama_directory if family == "llama" else gpt2_directory
    reference = _state(hf_toys.LitLM(directory=str(directory)))
    from safetensors import safe_open

    stored = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            stored |= set(handle.keys())
    read_by_stage = []
    for start, end in stages:
        module, layers, read = _stage_from(directory, range(start, end))
        mine = _tensors_of(layers, range(start, end))
        made = {name.removeprefix("model.") for name, t in _state(module).items() if not t.is_meta}
        expected = made & stored
        assert len(read) == len(set(read)) and set(read) == expected  # each key once, none of another stage
        for name, tensor in _state(module).items():
            if tensor.is_meta:
                assert id(tensor) not in mine, name
            else:
                assert torch.equal(tensor, reference[name]), name
        read_by_stage.append(set(read))
    tied = {"transformer.wte.weight"} if family == "gpt2" else set()  # the head's weight: read by both stages
    assert set.union(*read_by_stage) == stored and set.intersection(*read_by_stage) == tied


def test_a_base_model_checkpoint_loads_into_a_model_with_a_head(tmp_path) -> None:
    """A directory of the base model (keys without the base model's prefix) gives the head
    model its weights, as from_pretrained allows; the tied head takes wte's. A Llama head
    untied from the embedding is missing from it: named once at set-up, it keeps its own
    initialisation."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(13)
    AutoModel.from_config(hf_toys.gpt2_config()).save_pretrained(tmp_path / "gpt2")
    module, layers, read = _stage_from(tmp_path / "gpt2", range(6))
    assert "h.0.attn.c_attn.weight" in read and "transformer.h.0.attn.c_attn.weight" not in read
    assert torch.equal(module.model.lm_head.weight, AutoModel.from_pretrained(tmp_path / "gpt2").wte.weight)

    torch.manual_seed(13)
    AutoModel.from_config(hf_toys.llama_config()).save_pretrained(tmp_path / "llama")
    build, module = _on_meta(lambda: hf_toys.LitLM(AutoConfig.from_pretrained(tmp_path / "llama")))
    with pytest.warns(UserWarning, match=r"model.lm_head.weight.*not in .*llama.*keeps the values its own initialisation gives"):
        weights = pretrained_weights(module, tmp_path / "llama", built_on_meta=True)
    assert weights.missing == ["model.lm_head.weight"]


def test_pretrained_refusals_name_the_fix(tmp_path, gpt2_directory) -> None:
    """A directory for a model built whole, a directory without safetensors files, a
    stored shape that differs from the model's: one line each, before training."""
    from transformers import AutoConfig

    whole = hf_toys.LitLM(hf_toys.gpt2_config())
    with pytest.raises(DappleConfigError, match=r"DappleStrategy\(pretrained\): names weights for a model built on the meta device.*Fix: make the Hugging Face model from its config in configure_model"):
        pretrained_weights(whole, gpt2_directory, built_on_meta=False)
    _, meta = _on_meta(lambda: hf_toys.LitLM(AutoConfig.from_pretrained(gpt2_directory)))
    with pytest.raises(DappleConfigError, match=r"holds neither model.safetensors nor model.safetensors.index.json.*Fix: give the directory"):
        pretrained_weights(meta, tmp_path, built_on_meta=True)
    with pytest.raises(DappleConfigError, match=r"names nothing, which is not a Hugging Face model of LitLM \(those are: model\)"):
        pretrained_weights(meta, {"nothing": gpt2_directory}, built_on_meta=True)
    wider = hf_toys.gpt2_config()
    wider.n_embd = 32
    _, meta = _on_meta(lambda: hf_toys.LitLM(wider))
    with pytest.raises(DappleConfigError, match=r"stores transformer.wte.weight with shape \[32, 16\].*has shape \[32, 32\].*Fix: build the model from the directory's own config"):
        pretrained_weights(meta, gpt2_directory, built_on_meta=True)


def test_from_pretrained_while_building_on_meta_is_refused_with_the_fix(gpt2_directory) -> None:
    from transformers import AutoModelForCausalLM

    build = MetaBuild()
    with pytest.raises(DappleConfigError, match=r"^from_pretrained: is called while the model is built on the meta device.*Fix: .*DappleStrategy\(pretrained=directory\)"):
        with build.recording():
            AutoModelForCausalLM.from_pretrained(gpt2_directory)


def test_plan_auto_profiles_a_meta_build_one_layer_real_at_a_time(llama_directory) -> None:
    """The profile of a model built on the meta device: each layer is made (read from the
    directory) only while it is measured and freed before the next, and the sizes are those
    of profiling the model built whole."""
    from transformers import AutoConfig

    torch.set_num_threads(1)
    build, module = _on_meta(lambda: hf_toys.LitLM(AutoConfig.from_pretrained(llama_directory)))
    layers = _layers(module)
    weights = pretrained_weights(module, llama_directory, built_on_meta=True)
    made = build.layer_by_layer(module, weights)
    real_at_once: list[list[int]] = []

    def watched(layer):
        context = made(layer)

        class Watch:
            def __enter__(self):
                context.__enter__()
                real_at_once.append([i for i, each in enumerate(layers) if any(not p.is_meta for p in each.parameters())])

            def __exit__(self, *exc):
                return context.__exit__(*exc)

        return Watch()

    data = hf_toys.lm_batches(1)[0]
    sample = tuple(data[k][:2] for k in ("input_ids", "attention_mask", "labels"))
    profile = profile_one_layer_at_a_time(list(layers), sample, watched, module, device=torch.device("cpu"), name="LitLM")
    assert real_at_once == [[i] for i in range(6)]
    assert all(t.is_meta for t in module.parameters())  # every layer freed again
    assert set(weights.read_keys) == set(weights.keys[name][1] for name in weights.keys)  # the whole directory, each layer in turn
    whole = hf_toys.LitLM(directory=str(llama_directory))
    expected = profile_layers(_layers(whole), sample, name="LitLM", repeats=1, warmup=0)
    for ours, theirs in zip(profile.layers, expected.layers):
        assert (ours.name, ours.param_bytes, ours.output_bytes, ours.output_whole_bytes) == (theirs.name, theirs.param_bytes, theirs.output_bytes, theirs.output_whole_bytes)
        assert ours.forward_ms > 0 and ours.optimizer_ms > 0
    assert profile.meta["optimizer"] == "AdamW" and profile.input_bytes == expected.input_bytes


def test_a_hugging_face_model_whose_initialisation_did_not_run_is_refused_unless_loaded(gpt2_directory) -> None:
    """Were Hugging Face to skip its _init_weights while recorded (it does on the meta
    device when it knows it is there), the replay would give torch's defaults: refused,
    naming the tensors, unless a pretrained directory gives them their values."""
    from transformers import AutoConfig

    build, meta = _on_meta(lambda: hf_toys.LitLM(AutoConfig.from_pretrained(gpt2_directory)))
    for sub in meta.modules():
        sub.__dict__.pop("_is_hf_initialized", None)
    build.finish(meta)
    with pytest.raises(DappleConfigError, match=r"model.transformer.wte.weight: Hugging Face's initialisation of its model did not run while it was recorded"):
        build.check("LitLM")
    weights = pretrained_weights(meta, gpt2_directory, built_on_meta=True)
    build.check("LitLM", weights.loads)
