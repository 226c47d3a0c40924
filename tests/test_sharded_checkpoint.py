"""Sharded checkpoints (strategy/sharded_checkpoint.py): each stage leader writes its own
stage through torch.distributed.checkpoint, rank 0 the rest of Lightning's dict in meta.pt.

A 2-stage run (float64, Adam, clipping) saves a sharded directory after 3 steps: one DCP
file per stage leader, each holding only its own stage's entries. It resumes for 3 more
steps under other plans (1 stage on 2 replicas; 3 stages) and ends at plain training's
parameters after 6 steps (1e-10 relative). Converting it to a consolidated file gives what
the plain module loads and what the strategy resumes from; file -> directory -> file gives
the same checkpoint back. A save killed before its directory is swapped in leaves the
previous checkpoint whole.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy import sharded_checkpoint as sharded
from lightning_dapple.strategy.checkpoint import NAMED_MARKER, AtomicCheckpointIO
from lightning_dapple.strategy.resume import ResumableDataLoader
from lightning_toys import MLPModule, mlp_loader, single_device_run

TWO_STAGES = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}
DATA_PARALLEL = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1]}]}
THREE_STAGES = {
    "global_batch_size": 12,
    "micro_batches": 2,
    "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 3], "devices": [1]}, {"layers": [3, 5], "devices": [2]}],
}
REPO = Path(__file__).resolve().parents[1]


def _fit(root: Path, plan: dict, devices: int, steps: int, ckpt_path: Path | None = None, **strategy_kwargs) -> MLPModule:
    """Fit the float64 MLP under ``plan`` (spawned ranks) to ``steps``, a checkpoint every
    3 steps (an epoch) under ``root/ckpt``; returns the main process's module. The loader
    resumes where the checkpoint left it (a plain one would restart its epoch), so a
    resumed run sees the batches plain training sees."""
    strategy = DappleStrategy(plan=plan, start_method="spawn", timeout_s=60, **strategy_kwargs)
    every_epoch = ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root), gradient_clip_val=0.5,
        callbacks=[every_epoch],
    )
    model = MLPModule().double()
    trainer.fit(model, ResumableDataLoader(mlp_loader(3).dataset, batch_size=12), ckpt_path=str(ckpt_path) if ckpt_path is not None else None)
    return model


def _at_step(root: Path, step: int) -> Path:
    return next(p for p in (root / "ckpt").iterdir() if f"step={step}" in p.name)


def _relative_error(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert set(state) == set(reference)
    return max(float((state[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-30)) for k in reference)


def _files_and_keys(directory: Path) -> dict[str, set[str]]:
    """Each DCP file of a sharded checkpoint -> the entries stored in it."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(info.relative_path, set()).add(index.fqn)
    return files


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MLPModule]:
    """Three steps on two stages, saved sharded at step 3."""
    root = tmp_path_factory.mktemp("first")
    return root, _fit(root, TWO_STAGES, 2, 3, checkpoint="sharded")


@pytest.mark.timeout(600)
def test_each_stage_leader_writes_its_own_stage(first_run) -> None:
    root, model = first_run
    directory = _at_step(root, 3)
    assert directory.is_dir() and sharded.is_sharded(directory)
    assert sorted(p.name for p in directory.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert not [p.name for p in (root / "ckpt").iterdir() if p.name.startswith(".")]  # no temporary left
    files = _files_and_keys(directory)
    stage_of = lambda entry: int(entry.split("layers.")[1].split(".")[0]) >= 2  # noqa: E731
    for name, stage in (("__0_0.distcp", False), ("__1_0.distcp", True)):
        layered = [entry for entry in files[name] if "layers." in entry]
        assert layered and all(stage_of(entry) == stage for entry in layered), (name, sorted(files[name]))
        assert any(entry.startswith("optimizer_states/0/state/") for entry in files[name])
    meta = torch.load(directory / "meta.pt", weights_only=False)
    assert meta["global_step"] == 3 and "state_dict" not in meta and "optimizer_states" not in meta
    assert meta["dapple_sharded"]["keys"] == list(MLPModule().state_dict())
    # after fit rank 0 kept its own stage (gather_after_fit is off under "sharded"):
    # the spawning process got rank 0's layers trained, the others as they were built
    reference, _ = single_device_run(3, clip=0.5)
    built = MLPModule().double().state_dict()
    state = model.state_dict()
    assert torch.allclose(state["layers.0.linear.weight"], reference["layers.0.linear.weight"], rtol=0, atol=1e-10)
    assert torch.equal(state["layers.4.weight"], built["layers.4.weight"])


@pytest.mark.timeout(900)
def test_resume_under_other_plans_trains_like_one_device(first_run, tmp_path: Path) -> None:
    root, _ = first_run
    saved = _at_step(root, 3)
    reference, _ = single_device_run(3, clip=0.5, epochs=2)

    # one stage on two replicas: one writer (rank 0), saving without collectives
    replicated = _fit(tmp_path / "dp", DATA_PARALLEL, 2, 6, ckpt_path=saved, checkpoint="sharded")
    assert _relative_error(replicated.state_dict(), reference) < 1e-10
    final = _at_step(tmp_path / "dp", 6)
    assert sorted(p.name for p in final.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    sharded.consolidate(final, tmp_path / "dp.ckpt")
    assert _relative_error(torch.load(tmp_path / "dp.ckpt", weights_only=False)["state_dict"], reference) < 1e-10

    # three stages, the whole model gathered back after fit on request
    three = _fit(tmp_path / "three", THREE_STAGES, 3, 6, ckpt_path=saved, checkpoint="sharded", gather_after_fit=True)
    assert _relative_error(three.state_dict(), reference) < 1e-10
    assert len([p for p in _at_step(tmp_path / "three", 6).iterdir() if p.suffix == ".distcp"]) == 3


@pytest.mark.timeout(600)
def test_conversion_round_trip_loads_plainly_and_resumes(first_run, tmp_path: Path) -> None:
    root, _ = first_run
    saved = _at_step(root, 3)
    file = tmp_path / "consolidated.ckpt"
    sharded.consolidate(saved, file)
    checkpoint = torch.load(file, weights_only=False)
    plain = MLPModule().double()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: the module's own keys
    reference, _ = single_device_run(3, clip=0.5)
    assert _relative_error(plain.state_dict(), reference) < 1e-10
    optimizer = checkpoint["optimizer_states"][0]
    assert optimizer[NAMED_MARKER] and set(optimizer["state"]) == {name for name, _ in plain.named_parameters()}
    assert sorted(optimizer["param_groups"][0]["params"]) == sorted(name for name, _ in plain.named_parameters())
    assert checkpoint["global_step"] == 3 and "loops" in checkpoint and "dapple_sharded" not in checkpoint

    # file -> directory (the command line) -> file: the same checkpoint
    module = "lightning_dapple.strategy.sharded_checkpoint"
    again = tmp_path / "again.ckpt"
    for args in (["shard", str(file), str(tmp_path / "sharded")], ["consolidate", str(tmp_path / "sharded"), str(again)]):
        result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert result.returncode == 0, result.stderr[-2000:]
    assert _same(torch.load(again, weights_only=False), checkpoint)

    # the consolidated file resumes with the strategy as its own files do
    resumed = _fit(tmp_path / "resumed", TWO_STAGES, 2, 6, ckpt_path=file)
    assert _relative_error(resumed.state_dict(), single_device_run(3, clip=0.5, epochs=2)[0]) < 1e-10


def _checkpoint(step: int) -> dict:
    weight = torch.arange(6.0, dtype=torch.float64) * step
    return {
        "state_dict": {"w": weight, "tied": weight},
        "optimizer_states": [{"state": {"w": {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1, "params": ["w"]}], NAMED_MARKER: True}],
        "global_step": step,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["mid-write", "before-swap"])
def test_a_save_killed_before_the_swap_keeps_the_previous_checkpoint(tmp_path: Path, point: str) -> None:
    for step in (1, 2):
        AtomicCheckpointIO().save_checkpoint(_checkpoint(step), tmp_path / f"step{step}.ckpt")
    target = tmp_path / "last.ckpt"
    sharded.shard(tmp_path / "step1.ckpt", target)
    pid = os.fork()
    if pid == 0:  # the writer: dies inside the save
        try:
            if point == "mid-write":
                sharded._write_meta = lambda *args, **kwargs: os._exit(9)
            else:
                sharded._exchange = lambda *args, **kwargs: os._exit(9)
                sharded.os.replace = lambda *args, **kwargs: os._exit(9)
            sharded.shard(tmp_path / "step2.ckpt", target)
        finally:
            os._exit(3)  # reached only if the save did not die where it should
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the killed save's directory
    sharded.consolidate(target, tmp_path / "out.ckpt")
    previous = torch.load(tmp_path / "out.ckpt", weights_only=False)
    assert previous["global_step"] == 1 and torch.equal(previous["state_dict"]["tied"], _checkpoint(1)["state_dict"]["w"])
    sharded.shard(tmp_path / "step2.ckpt", target)  # the next save clears what the crash left, and replaces the old one
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    sharded.consolidate(target, tmp_path / "out.ckpt")
    latest = torch.load(tmp_path / "out.ckpt", weights_only=False)
    assert _same(latest, _checkpoint(2))
    assert latest["state_dict"]["tied"] is latest["state_dict"]["w"]  # a tied tensor, stored once, under both keys
