"""Tied weights across pipeline stages: a GPT whose head weight is its token embedding.

The tie is found in the layer list (``profile/ties.py``), priced by the cost model and the
simulator (a copy's memory on every stage holding one, one more AllReduce over all of
them), kept real on every such stage while the others are freed
(``strategy/tied_layers.py``), summed over every copy by the executor (``execute/tied.py``;
clipping counts it once) and checkpointed once under its original names. The executor
cases compare 3 Adam steps with clipping against one process in float64; the Trainer case
trains, checkpoints and resumes under another plan.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dapple  # noqa: F401  (registers the strategies)
from dist_harness import run_ranks
from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import stage_costs, stage_memory_bytes
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, TiedParams, profile_from_dict
from lightning_dapple.profile.profiler import profile_layers
from lightning_dapple.profile.ties import first_use_param_bytes, tied_parameters
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.simulate.plan_and_schedule import stage_memory
from lightning_dapple.simulate.timeline_png import draw_timeline
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.checkpoint import CheckpointLayout, consolidated_state_dict
from lightning_dapple.strategy.module_adapter import check_parameters_in_layers, key_owners, state_aliases
from lightning_dapple.strategy.tied_layers import KeptTensors, free_layer, retie
from tied_models import TiedGPTModule, gpt_loader, single_device_states, tied_gpt_layers
from tied_worker import CLIP, run_cases

TIE = (0, 4)  # the tied GPT's embedding layer and its norm + head layer
TIED_BYTES = 11 * 8 * 8  # the 11 x 8 float64 token embedding


# --------------------------------------------------------------------------- finding the tie


def test_the_tie_is_found_and_counted_once_in_the_profile() -> None:
    layers = tied_gpt_layers()
    assert layers[4].head.weight is layers[0].tok.weight
    ties = tied_parameters(list(layers))
    assert [tie.uses for tie in ties] == [((0, "tok.weight"), (4, "head.weight"))]
    assert ties[0].layers == TIE and ties[0].param_bytes == TIED_BYTES
    owned = first_use_param_bytes(list(layers))
    assert sum(owned) == sum(p.numel() * p.element_size() for p in layers.parameters())
    assert owned[4] == sum(p.numel() * p.element_size() for p in layers[4].ln_f.parameters())  # the head's weight is layer 0's
    profile = profile_layers(layers, torch.randint(1, 11, (3, 5)), repeats=1, warmup=0)
    assert profile.tied == (TiedParams(TIE, float(TIED_BYTES), ("0.tok.weight",)),)
    assert [layer.param_bytes for layer in profile.layers] == owned
    module = TiedGPTModule()
    check_parameters_in_layers(module, module.layers, "layers")  # a tie is no longer refused


def test_profile_json_keeps_the_tie_and_old_files_still_load() -> None:
    profile = _profile()
    again = profile_from_dict(json.loads(profile.to_json()))
    assert again.tied == profile.tied and again.layers == profile.layers
    old = {k: v for k, v in profile.to_dict().items() if k != "tied"}  # written before ties existed
    assert profile_from_dict(old).tied == ()
    for bad in ([3], [4, 0], [0, 9]):
        with pytest.raises(DappleConfigError, match="tied"):
            profile_from_dict({**profile.to_dict(), "tied": [{"layers": bad, "param_bytes": 8.0}]})


# --------------------------------------------------------------------------- cost model, simulator


def _profile(tied: bool = True) -> ModelProfile:
    """Five layers of 1 MB each; layer 0's includes 0.4 MB that layer 4 uses too."""
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e5, 1e6, 1e5) for i in range(5))
    return ModelProfile(4, layers, tied=(TiedParams(TIE, 4e5, ("0.tok.weight",)),) if tied else ())


def _plan(stages: list[dict]) -> object:
    return plan_from_dict({"global_batch_size": 16, "micro_batches": 4, "stages": stages})


STRAIGHT = [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]
TWO_BY_TWO = [{"layers": [0, 2], "devices": [0, 1]}, {"layers": [2, 5], "devices": [2, 3]}]
DP = [{"layers": [0, 5], "devices": [0, 1, 2, 3]}]


def test_the_cost_model_holds_a_copy_on_every_stage_and_prices_one_allreduce_over_them() -> None:
    cluster = Cluster(1, 4)
    plan = _plan(TWO_BY_TWO)
    tied, untied = (stage_costs(_profile(flag), cluster, plan.stages, 4) for flag in (True, False))
    assert tied[0].param_bytes == untied[0].param_bytes == 2e6  # layer 0 counts the tie already
    assert tied[1].param_bytes == untied[1].param_bytes + 4e5  # the copy beside the head
    assert stage_memory_bytes(tied[1], 2, cluster) - stage_memory_bytes(untied[1], 2, cluster) == pytest.approx(4e5 * (2 + cluster.optimizer_state_factor))
    # the copies leave the stages' buckets and are summed over all 4 devices instead
    assert tied[0].allreduce_ms == pytest.approx(cluster.allreduce_ms(2e6 - 4e5, (0, 1)))
    assert tied[1].allreduce_ms == pytest.approx(untied[1].allreduce_ms)
    assert tied[0].tied == tied[1].tied == ((0, pytest.approx(cluster.allreduce_ms(4e5, (0, 1, 2, 3)))),)
    assert tied[0].exposed_allreduce_ms == pytest.approx(untied[0].exposed_allreduce_ms - untied[0].allreduce_ms + tied[0].allreduce_ms + tied[0].tied[0][1])
    straight = stage_costs(_profile(), cluster, _plan(STRAIGHT).stages, 4)
    assert straight[0].allreduce_ms == straight[1].allreduce_ms == 0.0 and straight[0].tied[0][1] == pytest.approx(cluster.allreduce_ms(4e5, (0, 1)))
    dp = stage_costs(_profile(), cluster, _plan(DP).stages, 4)[0]  # one stage holds the tie once: its own buckets sum it
    assert dp.tied == () and dp.param_bytes == 5e6 and dp.allreduce_ms == pytest.approx(cluster.allreduce_ms(5e6, (0, 1, 2, 3)))


def test_stages_on_the_same_devices_hold_one_copy_of_the_tie_and_sum_it_over_those_devices_once() -> None:
    """Under V the embedding's stage and the head's run on the same devices: one parameter
    there (the head's stage adds no copy, unlike under interleaving), and the tie's AllReduce
    runs over those devices, each once; on one device per group there is nothing to sum."""
    cluster = Cluster(1, 4)
    cuts = [[0, 1], [1, 3], [3, 4], [4, 5]]

    def chunked(schedule: str, placement: list[int], groups: list[list[int]]):
        stages = [{"layers": cut, "devices": groups[g]} for cut, g in zip(cuts, placement)]
        return plan_from_dict({"global_batch_size": 16, "micro_batches": 4, "schedule": schedule, "stages": stages})

    for groups, ranks in (([[0, 1], [2, 3]], (0, 1)), ([[0], [1]], (0,))):
        v = chunked("zbv", [0, 1, 1, 0], groups)
        tied, untied = (stage_costs(_profile(flag), cluster, v.stages, 4) for flag in (True, False))
        assert [c.param_bytes for c in tied] == [c.param_bytes for c in untied]  # layer 0 counts the tie, once per device
        assert tied[0].tied == tied[3].tied == ((0, pytest.approx(cluster.allreduce_ms(4e5, ranks))),)
        assert tied[1].tied == tied[2].tied == ()
        assert stage_memory(v, _profile(), cluster)[0] == pytest.approx(stage_memory(v, _profile(False), cluster)[0])
    interleaved = stage_costs(_profile(), cluster, chunked("interleaved", [0, 1, 0, 1], [[0, 1], [2, 3]]).stages, 4)
    assert interleaved[3].param_bytes == 1e6 + 4e5  # another group: a copy of its own
    assert interleaved[0].tied[0][1] == pytest.approx(cluster.allreduce_ms(4e5, (0, 1, 2, 3)))
    assert simulate_plan(chunked("zbv", [0, 1, 1, 0], [[0], [1]]), _profile(), cluster).transfers.get("tied0") is None


def _ready_ends(result) -> list[float]:
    """When each stage has done everything before the tied AllReduce: its compute, its
    own AllReduce spans and its gradient buckets."""
    ends = []
    for stage in result.stages:
        own = [span.end_ms for span in stage.spans if span.kind != "TAR"]
        own += [span.end_ms for span in result.transfers.get(f"AR{stage.stage}", [])]
        ends.append(max(own))
    return ends


@pytest.mark.parametrize("ooo", [False, True])
def test_the_simulator_runs_the_tied_allreduce_after_every_holding_stage_and_draws_it(ooo: bool, tmp_path: Path) -> None:
    cluster = Cluster(1, 4)
    plan = replace(_plan(TWO_BY_TWO), ooo=ooo)
    result = simulate_plan(plan, _profile(), cluster)
    spans = result.transfers["tied0"]
    assert len(spans) == 1
    duration = stage_costs(_profile(), cluster, plan.stages, 4)[0].tied[0][1]
    assert spans[0].end_ms - spans[0].start_ms == pytest.approx(duration)
    assert spans[0].start_ms == pytest.approx(max(_ready_ends(result)))
    assert result.latency_ms == pytest.approx(spans[0].end_ms)
    assert [stage.end_ms for stage in result.stages] == pytest.approx([spans[0].end_ms] * 2)
    for device in range(4):
        assert [s for s in result.timelines[device] if s.kind == "TAR"] == spans
    without = simulate_plan(plan, replace(_profile(), tied=()), cluster)  # the same compute, no tie to sum
    assert [stage.busy_ms for stage in result.stages] == pytest.approx([stage.busy_ms for stage in without.stages])
    assert draw_timeline(result, tmp_path / "t.png").stat().st_size > 0


def test_the_tied_allreduce_waits_for_the_last_holding_stage() -> None:
    """A three-stage plan with the tie on stages 0 and 2: it starts when the later of the
    two is done, and stage 1 takes no part."""
    cluster = Cluster(1, 3)
    stages = [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 4], "devices": [1]}, {"layers": [4, 5], "devices": [2]}]
    result = simulate_plan(_plan(stages), _profile(), cluster)
    span = result.transfers["tied0"][0]
    ready = _ready_ends(result)
    assert span.start_ms == pytest.approx(max(ready[0], ready[2])) and ready[0] != pytest.approx(ready[2])
    assert result.stages[1].end_ms == pytest.approx(ready[1])
    assert not [s for s in result.timelines[1] if s.kind == "TAR"]
    assert span.end_ms - span.start_ms == pytest.approx(cluster.allreduce_ms(4e5, (0, 2)))


# --------------------------------------------------------------------------- freeing, checkpoints


@pytest.mark.parametrize("swap", [False, True])
def test_freeing_other_stages_keeps_this_stages_copy_and_retie_restores_one_parameter(swap: bool) -> None:
    """Under torch's swapping conversion (``set_swap_module_params_on_conversion``) a
    plain ``.to("meta")`` of the freed layer would empty the kept layer's weight too."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        for kept_index, freed_index, freed_name in ((0, 4, "head.weight"), (4, 0, "tok.weight")):
            layers = tied_gpt_layers()
            weight = layers[0].tok.weight
            before = weight.detach().clone()
            skeleton = free_layer(layers[freed_index], KeptTensors([layers[kept_index]]))
            kept_name = "tok.weight" if kept_index == 0 else "head.weight"
            assert layers[kept_index].get_parameter(kept_name) is weight and torch.equal(weight.detach(), before)
            assert skeleton.get_parameter(freed_name).is_meta and skeleton.get_parameter(freed_name) is not weight
            rebuilt = skeleton.to_empty(device="cpu")
            rebuilt.get_parameter(freed_name).data.copy_(before)
            layers[freed_index] = rebuilt
            assert layers[4].head.weight is not layers[0].tok.weight
            retie(layers, tied_parameters(list(tied_gpt_layers())))
            assert layers[4].head.weight is layers[0].tok.weight
        # a sub-module two layers share: the kept layer's stays whole
        shared = nn.Linear(3, 3).double()
        a, b = nn.Sequential(shared, nn.Tanh()), nn.Sequential(nn.Linear(3, 3), shared)
        free_layer(b, KeptTensors([a]))
        assert a[0] is shared and not shared.weight.is_meta and b[1].weight.is_meta and b[1] is not shared
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_a_checkpoint_holds_the_tie_once_under_both_names() -> None:
    module = TiedGPTModule()
    aliases = state_aliases(module, module.layers)
    assert aliases == {"layers.4.head.weight": "layers.0.tok.weight"}
    layout = CheckpointLayout(
        key_owners(module, module.layers), [n for n, _ in module.named_parameters()], stage_leaders=(0,), global_rank=0, aliases=aliases, layers=((0, 5),)
    )
    state = consolidated_state_dict(module, layout)
    assert list(state) == list(module.state_dict())  # original names, original order
    assert state["layers.4.head.weight"] is state["layers.0.tok.weight"]
    plain = TiedGPTModule()
    torch.nn.init.zeros_(plain.layers[0].tok.weight)
    plain.load_state_dict(state)
    assert plain.layers[4].head.weight is plain.layers[0].tok.weight
    assert torch.equal(plain.layers[0].tok.weight, module.layers[0].tok.weight)


# --------------------------------------------------------------------------- executor

EXECUTOR_PLANS = {
    "straight-2": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}],
    "2x2": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3]}],
    "3:1": [{"layers": [0, 4], "devices": [0, 1, 2]}, {"layers": [4, 5], "devices": [3]}],
    "3-stage": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 4], "devices": [1]}, {"layers": [4, 5], "devices": [2]}],
    "dp-2": [{"layers": [0, 5], "devices": [0, 1]}],
}
VARIANTS = [("dapple", False, "never"), ("dapple", True, "always"), ("dapple", True, "except_last"), ("gpipe", True, "always")]


def _executor_cases() -> list[tuple[str, dict]]:
    cases = []
    for name, stages in EXECUTOR_PLANS.items():
        for schedule, ooo, recompute in VARIANTS:
            data = {
                "global_batch_size": 12, "micro_batches": 3, "schedule": schedule, "ooo": ooo,
                "stages": [{**stage, "recompute": recompute} for stage in stages],
            }
            cases.append((f"{name}/{schedule}/ooo={ooo}/{recompute}", data))
    return cases


def _check_executor(cases: list[tuple[str, dict]], results: dict, tolerance: float) -> None:
    """Every rank within ``tolerance`` of one process (parameters relative to the model's
    scale, losses, clipping norms), and every copy of the tie equal bit for bit."""
    assert "__errors__" not in results, results.get("__errors__")
    for index, (name, data) in enumerate(cases):
        per_rank = {rank: results[rank][index] for rank in range(4) if results[rank][index] is not None}
        holders = {stage for stage, spec in enumerate(data["stages"]) if any(spec["layers"][0] <= layer < spec["layers"][1] for layer in TIE)}
        for rank, res in per_rank.items():
            assert min(res["reference_norms"]) > CLIP, "clipping must be active for the norm to matter"
            assert res["relative_diff"] <= tolerance, (name, rank, res["relative_diff"])
            assert res["loss_diff"] <= tolerance and res["norm_diff"] <= tolerance, (name, rank, res)  # the tie counted once in the norm
            split = len(holders) > 1
            assert res["tied_in_runner"] == (1 if split and res["stage"] in holders else 0), (name, rank)
        copies = [res["tied_copy"] for res in per_rank.values() if res["tied_copy"] is not None]
        if len(holders) > 1:
            assert len(copies) == sum(len(data["stages"][s]["devices"]) for s in holders), name
            assert all(copy == copies[0] for copy in copies), f"{name}: tied copies differ"  # bit for bit


@pytest.mark.timeout(600)
def test_tied_gpt_matches_one_process_on_every_plan_and_the_copies_stay_identical() -> None:
    cases = _executor_cases()
    results = run_ranks(run_cases, 4, [data for _, data in cases], timeout_s=500)
    _check_executor(cases, results, 1e-10)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tied_gpt_on_ranks_sharing_one_gpu_keeps_its_copies_identical() -> None:
    """Four ranks on one GPU (gloo, pinned staging; the tied AllReduce of CUDA tensors over
    gloo): the copies stay bit-identical; against the CPU reference within GPU rounding."""
    cases = [(name, data) for name, data in _executor_cases() if name.split("/")[0] in ("2x2", "3:1", "3-stage")]
    results = run_ranks(run_cases, 4, [data for _, data in cases], "cuda:0", timeout_s=500)
    _check_executor(cases, results, 1e-8)


# --------------------------------------------------------------------------- Trainer


class TieProbe(Callback):
    """After fit, rank 0 writes whether its whole model has the tie back (one Parameter)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def teardown(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == 0:
            layers = pl_module.layers
            tied = layers[4].head.weight is layers[0].tok.weight
            Path(self.directory, "tie.json").write_text(json.dumps({"tied": tied, "weight": layers[0].tok.weight.detach().reshape(-1).tolist()}))


def _trainer(out: Path, stages: list[dict], devices: int, steps: int, callbacks: list, schedule: str = "dapple", **kwargs) -> Trainer:
    plan = {"global_batch_size": 12, "micro_batches": 3, "schedule": schedule, "stages": stages}
    ooo = schedule == "dapple"  # chunked schedules place their own weight gradients
    return Trainer(
        strategy=DappleStrategy(plan=plan, start_method="spawn", timeout_s=60, ooo=ooo, recompute="always"),
        accelerator="cpu", devices=devices, precision="64-true", max_steps=steps, gradient_clip_val=CLIP, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out), callbacks=callbacks, **kwargs,
    )


def _max_relative(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    scale = max(float(value.abs().max()) for value in reference.values())
    return max(float((state[key] - reference[key]).abs().max()) for key in reference) / scale


@pytest.mark.timeout(600)
def test_trainer_trains_checkpoints_and_resumes_the_tied_model_under_another_plan(tmp_path: Path) -> None:
    references = single_device_states(6, CLIP)
    first = tmp_path / "first"
    every_epoch = ModelCheckpoint(dirpath=str(first / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    model = TiedGPTModule()
    straight = [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]
    _trainer(first, straight, 2, 6, [every_epoch, TieProbe(str(first))]).fit(model, gpt_loader())
    probe = json.loads((first / "tie.json").read_text())
    assert probe["tied"], "rank 0's whole model lost the tie after fit"
    assert _max_relative({"w": torch.tensor(probe["weight"], dtype=torch.float64)}, {"w": references[-1]["layers.0.tok.weight"].reshape(-1)}) <= 1e-10
    assert _max_relative(model.state_dict(), references[-1]) <= 1e-10

    checkpoint = next(p for p in (first / "ckpt").iterdir() if "step=3" in p.name)
    saved = torch.load(checkpoint, weights_only=False)
    state = saved["state_dict"]
    assert state["layers.4.head.weight"].untyped_storage().data_ptr() == state["layers.0.tok.weight"].untyped_storage().data_ptr()
    assert "layers.0.tok.weight" in saved["optimizer_states"][0]["state"]
    assert "layers.4.head.weight" not in saved["optimizer_states"][0]["state"]  # one optimizer entry for the tie
    plain = TiedGPTModule()
    plain.load_state_dict(state)  # strict, without dapple
    assert plain.layers[4].head.weight is plain.layers[0].tok.weight
    assert _max_relative(plain.state_dict(), references[2]) <= 1e-10

    resumed = tmp_path / "resumed"  # the tie now on stages 0 and 2, stage 1 without it
    three = [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 4], "devices": [1]}, {"layers": [4, 5], "devices": [2]}]
    again = TiedGPTModule()
    _trainer(resumed, three, 3, 6, [TieProbe(str(resumed))], enable_checkpointing=False).fit(again, gpt_loader(), ckpt_path=str(checkpoint))
    assert json.loads((resumed / "tie.json").read_text())["tied"]
    assert _max_relative(again.state_dict(), references[-1]) <= 1e-10



@pytest.mark.timeout(300)
def test_trainer_trains_the_tied_model_under_v_with_embedding_and_head_on_one_rank(tmp_path: Path) -> None:
    """ZB-V on 2 ranks puts the embedding's stage and the head's on rank 0: one parameter
    there takes both stages' gradients; after fit the whole model matches one process, its
    tie intact, and the checkpoint holds the tie once."""
    references = single_device_states(3, CLIP)
    v = [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 2], "devices": [1]}, {"layers": [2, 4], "devices": [1]}, {"layers": [4, 5], "devices": [0]}]
    saved = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    model = TiedGPTModule()
    _trainer(tmp_path, v, 2, 3, [saved, TieProbe(str(tmp_path))], schedule="zbv").fit(model, gpt_loader())
    assert json.loads((tmp_path / "tie.json").read_text())["tied"]
    assert _max_relative(model.state_dict(), references[-1]) <= 1e-10
    state = torch.load(next((tmp_path / "ckpt").iterdir()), weights_only=False)
    assert _max_relative(state["state_dict"], references[-1]) <= 1e-10
    assert "layers.4.head.weight" not in state["optimizer_states"][0]["state"]  # one optimizer entry for the tie


class ReadTieGPT(LightningModule):
    """A head written as ``F.linear(h, self.wte.weight)`` (no head module): the layer traced
    from forward that computes the logits reads the embedding's weight, a tie with the
    layer that calls ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.ln_f = nn.LayerNorm(8)

    def forward(self, idx):
        h = self.wte(idx)
        for block in self.blocks:
            h = h + block(h)
        return F.linear(self.ln_f(h), self.wte.weight)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


@pytest.mark.timeout(300)
def test_a_weight_read_from_forward_by_another_stage_trains_there_and_is_checkpointed_once(tmp_path: Path) -> None:
    """The stage computing the logits holds the embedding's weight without its module: that
    copy stays a parameter of the module there, so its optimizer steps it with the tie's
    summed gradient, and both copies stay one device's weight."""
    tokens = torch.randint(0, 10, (12, 6), generator=torch.Generator().manual_seed(1))
    loader = lambda: DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)  # noqa: E731

    def fit(strategy, devices: int, callbacks: list) -> dict:
        model = ReadTieGPT().double()
        Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=callbacks,
        ).fit(model, loader())
        return model.state_dict()

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}
    saved = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3)
    ours = fit(DappleStrategy(plan=plan, layers="auto", start_method="spawn", timeout_s=60), 2, [saved])
    plain = fit("auto", 1, [])
    assert _max_relative(ours, plain) <= 1e-12
    checkpoint = torch.load(next((tmp_path / "ckpt").iterdir()), weights_only=False)
    assert _max_relative(checkpoint["state_dict"], plain) <= 1e-12
    assert "wte.weight" in checkpoint["optimizer_states"][0]["state"]
