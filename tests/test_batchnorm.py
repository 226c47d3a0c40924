"""BatchNorm on a pipeline (``execute/batchnorm.py``; GPipe 2.2): replicas of a stage never
diverge, ``sync`` normalises over the whole micro-batch across the replicas, ``deferred``
moves running statistics once per step from the whole global batch.

The executor cases run in one spawned group of 4 gloo ranks (float64, Adam, 3 steps) on a
CNN with BatchNorm inside layers and as a layer of its own, and compare every rank's
parameters, running statistics and evaluation with one process (``batchnorm_worker``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from batchnorm_worker import CNNModule, StateDump, cnn_loader, make_model, reference_run, run_cases
from dist_harness import run_ranks
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.batchnorm import PipelineBatchNorm, convert_batchnorm
from lightning_dapple.strategy import DappleStrategy

DP = [{"layers": [0, 5], "devices": [0, 1]}]
HYBRID = [{"layers": [0, 2], "devices": [0, 1]}, {"layers": [2, 5], "devices": [2, 3]}]
STRAIGHT = [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]


def _plan(stages: list, micro_batches: int, schedule: str = "dapple", ooo: bool = False, recompute: str = "never") -> dict:
    return {
        "global_batch_size": 24, "micro_batches": micro_batches, "schedule": schedule, "ooo": ooo,
        "stages": [{**stage, "recompute": recompute} for stage in stages],
    }


CASES = [
    # (a) replicas never diverge: the first replica's buffers, also under recomputation
    ("default", _plan(DP, 2)),
    ("default", _plan(HYBRID, 2)),
    ("default", _plan(HYBRID, 2, "gpipe", recompute="always")),
    # (b) statistics over the stage's replicas: at M=1 one process on the whole batch
    ("sync", _plan(DP, 1)),
    ("sync", _plan(HYBRID, 1)),
    ("sync", _plan(HYBRID, 1, ooo=True, recompute="always")),
    ("sync", _plan(DP, 2, ooo=True, recompute="always")),
    # (c) running statistics once per step from the whole global batch
    ("deferred", _plan(DP, 4)),
    ("deferred", _plan(STRAIGHT, 4)),
    ("deferred", _plan(DP, 4, recompute="always")),
    ("deferred", _plan(STRAIGHT, 4, ooo=True, recompute="always")),
    ("both", _plan(HYBRID, 2, ooo=True, recompute="except_last")),
]


def _diff(a: dict, b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((torch.as_tensor(a[k]).double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def results() -> dict:
    got = run_ranks(run_cases, 4, CASES, timeout_s=500)
    assert "__errors__" not in got, got.get("__errors__")
    return got


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{m}-{len(p['stages'])}st-{p['stages'][0]['devices']}-M{p['micro_batches']}-{p['stages'][0]['recompute']}{'-ooo' if p['ooo'] else ''}" for m, p in CASES])
def test_stage_matches_one_process(results: dict, case: int) -> None:
    """Every rank's parameters and buffers equal the reference to 1e-10 (num_batches_tracked
    exactly), replicas of a stage hold bit-identical state, and every rank's evaluation
    (each replica evaluates its own rows) equals the reference model's."""
    mode, plan = CASES[case]
    replicas = len(plan["stages"][0]["devices"])
    reference, evaluated = reference_run(mode, replicas, plan["micro_batches"])
    per_rank = [results[rank][case] for rank in range(4) if results[rank][case] is not None]
    for got in per_rank:
        for index, state in got["state"].items():
            expected = reference[index].state_dict()
            assert _diff(state, expected) < 1e-10, (mode, index, got["replica"], _diff(state, expected))
            for key, value in state.items():
                if key.endswith("num_batches_tracked"):
                    assert int(value) == int(expected[key]), (key, int(value), int(expected[key]))
        assert float((torch.as_tensor(got["eval"]) - evaluated).abs().max()) < 1e-10
        for other in per_rank:
            if other["stage"] == got["stage"]:
                for index, state in got["state"].items():
                    assert all((value == other["state"][index][key]).all() for key, value in state.items())


def test_reference_modes_differ() -> None:
    """The four reference semantics are told apart by the running statistics they leave,
    so each case above could fail with the wrong one."""
    stats = {}
    for mode in ("default", "sync", "deferred", "both"):
        model, _ = reference_run(mode, 2, 2)
        stats[mode] = torch.cat([model[0].norm.running_var, model[3].running_var, model[3].num_batches_tracked.double().view(1)])
    modes = list(stats)
    for i, a in enumerate(modes):
        for b in modes[i + 1 :]:
            assert float((stats[a] - stats[b]).abs().max()) > 1e-6, (a, b)


def test_conversion_shares_state_and_follows_every_reference() -> None:
    """The swapped-in module holds the original's parameters and buffers (the same state-dict
    keys, checkpoints load into the plain module), and a second attribute naming the same
    BatchNorm (a handle beside the layer list) is swapped too."""
    root = nn.Module()
    root.layers = make_model()
    root.head = root.layers[3]
    before = root.state_dict(keep_vars=True)
    replaced = convert_batchnorm(root, list(root.layers), None, 0, 1, sync=False, deferred=True)
    assert replaced == 3
    assert isinstance(root.layers[3], PipelineBatchNorm) and root.head is root.layers[3]
    assert isinstance(root.layers[0].norm, PipelineBatchNorm)
    after = root.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    untouched = make_model()
    assert convert_batchnorm(untouched, list(untouched), None, 0, 1, sync=True, deferred=False) == 0  # one replica: nothing to sync


def test_layers_traced_from_forward_run_the_converted_modules() -> None:
    """A layer traced from ``forward`` holds the module's children itself (not under the
    module): it must call the swapped-in BatchNorm too."""
    from lightning_dapple.profile.traced_layers import traced_layers

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, bias=False)
            self.norm = nn.BatchNorm2d(4)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.flatten(F.adaptive_avg_pool2d(torch.relu(self.norm(self.conv(x))), 1), 1))

    net = Net().double()
    layers = traced_layers(net, [(torch.randn(1, 3, 6, 6, dtype=torch.float64),), (torch.randn(2, 3, 6, 6, dtype=torch.float64),)])
    assert convert_batchnorm(net, list(layers), None, 0, 1, sync=False, deferred=True) == 1
    called = [m for layer in layers for m in layer.modules() if isinstance(m, nn.BatchNorm2d | PipelineBatchNorm)]
    assert called and all(isinstance(m, PipelineBatchNorm) for m in called) and isinstance(net.norm, PipelineBatchNorm)
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    for layer in layers:
        x = layer(x)
    assert int(net.norm.num_batches_tracked) == 0 and float(net.norm.deferred_count) == 5 * 4 * 4  # deferred, not updated


def test_a_users_sync_batchnorm_on_one_replica_is_plain_batchnorm() -> None:
    """``nn.SyncBatchNorm`` would synchronise over the whole job (every stage) and refuses CPU
    tensors: on a stage without replicas it becomes plain BatchNorm."""
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(4).double()
    layers = nn.Sequential(nn.SyncBatchNorm(4).double())
    assert convert_batchnorm(layers, list(layers), None, 0, 1, sync=False, deferred=False) == 1
    x = torch.randn(6, 4, dtype=torch.float64)
    assert torch.allclose(layers(x), plain(x), atol=1e-12)
    assert torch.allclose(layers[0].running_var, plain.running_var, atol=1e-12) and int(layers[0].num_batches_tracked) == 1


def test_a_batchnorm_with_its_own_forward_is_refused() -> None:
    class Custom(nn.BatchNorm1d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    layers = nn.Sequential(nn.Linear(3, 4), Custom(4))
    with pytest.raises(DappleConfigError, match="overrides forward"):
        convert_batchnorm(layers, list(layers), None, 0, 1, sync=False, deferred=True)


def _fit(tmp_path: Path, plan: dict, devices: int, callbacks: list, **kwargs) -> CNNModule:
    strategy = DappleStrategy(plan=plan, start_method="spawn", timeout_s=60, **kwargs.pop("strategy_kwargs", {}))
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=callbacks, **kwargs,
    )
    model = CNNModule()
    trainer.fit(model, cnn_loader())
    return model


def _layers_state(reference: nn.Module) -> dict[str, torch.Tensor]:
    return {f"layers.{key}": value for key, value in reference.state_dict().items()}


@pytest.mark.timeout(300)
def test_trainer_sync_batchnorm_at_one_micro_batch_equals_one_process(tmp_path: Path) -> None:
    """``Trainer(sync_batchnorm=True)`` on a 2-replica stage at M=1 is one process on the whole
    batch (parameters and running statistics), on both ranks, and the checkpoint holds exactly
    what each rank holds."""
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    _fit(tmp_path, _plan(DP, 1), 2, [StateDump(str(tmp_path)), checkpoints], sync_batchnorm=True)
    expected = _layers_state(reference_run("sync", 2, 1)[0])
    saved = torch.load(next((tmp_path / "ckpt").glob("*.ckpt")), weights_only=False)["state_dict"]
    for rank in range(2):
        state = torch.load(tmp_path / f"state_rank{rank}.pt")
        assert _diff(state, expected) < 1e-10, rank
        assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved), rank


@pytest.mark.timeout(300)
def test_trainer_deferred_batchnorm_on_two_stages_with_recomputation(tmp_path: Path) -> None:
    """``DappleStrategy(deferred_batchnorm=True)``: running statistics once per step from the
    global batch, on each stage; the whole model handed back to the plain module equals it."""
    plan = _plan(STRAIGHT, 4, recompute="always")
    model = _fit(tmp_path, plan, 2, [StateDump(str(tmp_path))], strategy_kwargs={"deferred_batchnorm": True})
    expected = _layers_state(reference_run("deferred", 1, 4)[0])
    for rank in range(2):
        state = torch.load(tmp_path / f"state_rank{rank}.pt")
        assert state and _diff(state, {k: expected[k] for k in state}) < 1e-10, rank
    assert not any(isinstance(m, PipelineBatchNorm) for m in model.modules())  # the caller's module, loaded back
    assert _diff(model.state_dict(), expected) < 1e-10
    assert int(model.layers[3].num_batches_tracked) == 3


def test_a_foreign_layer_sync_plugin_is_refused(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.layer_sync import LayerSync

    class Custom(LayerSync):
        def apply(self, model: nn.Module) -> nn.Module:
            return model

        def revert(self, model: nn.Module) -> nn.Module:
            return model

    strategy = DappleStrategy(plan=_plan([{"layers": [0, 5], "devices": [0]}], 1))
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_steps=1, logger=False, plugins=[Custom()],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    with pytest.raises(DappleConfigError, match="layer-sync plugin"):
        trainer.fit(CNNModule(), cnn_loader())



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["default", "deferred"])
def test_one_gpu_with_recomputation_moves_statistics_as_one_process(tmp_path: Path, mode: str) -> None:
    """On a GPU the module's buffers are new tensors once moved to the device, after the runner
    was built: a replay must restore those (not the CPU originals), so running statistics
    move once per micro-batch (default) or once per step (deferred), as in one process."""
    plan = _plan([{"layers": [0, 5], "devices": [0]}], 2, ooo=True, recompute="always")
    strategy = DappleStrategy(plan=plan, timeout_s=60, deferred_batchnorm=mode == "deferred")
    trainer = Trainer(
        strategy=strategy, accelerator="gpu", devices=1, precision="64-true", max_steps=3, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    model = CNNModule()
    trainer.fit(model, cnn_loader())
    state = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    assert _diff(state, _layers_state(reference_run(mode, 1, 2)[0])) < 1e-10
    assert int(state["layers.3.num_batches_tracked"]) == (3 if mode == "deferred" else 6)
