"""dapple-train's command line beyond the recipes: resuming from a checkpoint (ckpt_path),
keys added with ``+`` that the schema does not have, a cluster file by path and recipes or
clusters of one's own through ``--config-dir``, Hydra's errors with a fix, and the warning
for more CPU processes than cores."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dapple.app import train
from lightning_dapple.cluster import usable_cores

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "lightning_dapple" / "conf"
# two CPU processes, float64, one step per epoch (32 samples, global batch 32): a resumed run
# sees the rows of each step the straight run sees (the loader reshuffles them within the batch)
RESUMABLE = [
    "recipe=bert_tiny", "trainer.devices=2", "trainer.precision=64-true", "data.num_samples=32", "strategy.micro_batches=2",
    "trainer.enable_checkpointing=true", "trainer.enable_progress_bar=false", "trainer.val_check_interval=null", "trainer.limit_val_batches=0",
    "outputs.simulated_timeline=false", "outputs.measured_timeline=false", "outputs.plan_table=false",
]


def _app(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)
    return subprocess.run([sys.executable, "-m", "lightning_dapple.app.train", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))


def _app_here(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Run ``dapple-train`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["dapple-train", *args, "hydra/job_logging=none", "hydra/hydra_logging=none"])
    code = 0
    try:
        train.main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(open(run_dir / "metrics.csv")) if row.get("train_loss")}


@pytest.mark.timeout(300)
def test_a_resumed_run_ends_where_a_straight_run_ends(tmp_path: Path) -> None:
    steps = 3
    first = _app([*RESUMABLE, f"trainer.max_steps={steps}", f"hydra.run.dir={tmp_path / 'first'}"])
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    resumed = _app([*RESUMABLE, f"trainer.max_steps={2 * steps}", f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'resumed'}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = _app([*RESUMABLE, f"trainer.max_steps={2 * steps}", f"hydra.run.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]

    resumed_losses, straight_losses = _losses(tmp_path / "resumed"), _losses(tmp_path / "straight")
    assert sorted(resumed_losses) == list(range(steps, 2 * steps))  # the resumed run starts at step N
    assert [resumed_losses[s] for s in range(steps, 2 * steps)] == pytest.approx([straight_losses[s] for s in range(steps, 2 * steps)], rel=1e-12)
    a = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert a["global_step"] == b["global_step"] == 2 * steps
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert value.dtype == torch.float64 or not value.is_floating_point()
        torch.testing.assert_close(value, b["state_dict"][key], rtol=0, atol=1e-12)  # float64 sums in another row order: 1e-15 apart


@pytest.mark.parametrize(
    "args, message",
    [
        (["+strategy.micro_batchs=4"], "strategy.micro_batchs: is not an option of strategy. Fix: use one of ['launcher', 'layers', 'loss_reduction', 'micro_batches'"),
        (["+cluster.memory=2"], "cluster.memory: is not an option of cluster. Fix: use one of ['allreduce_latency_ms'"),
        (["+outputs.timeline=false"], "outputs.timeline: is not an option of outputs"),
        (["+trainer.max_step=3"], "trainer.max_step: is not an option of trainer. Fix: use one of ['accelerator'"),
        (["+seeds=3"], "seeds: is not a key of dapple-train's config. Fix: use only ['ckpt_path'"),
        (["strategy.micro_batch=4"], "Key 'micro_batch' not in 'StrategyConfig'. Fix: use one of ['launcher', 'layers'"),
        (["recipe=nope"], "Could not find 'recipe/nope' (available: bert, bert_pipeline_tiny, bert_tiny, gnmt, gnmt_tiny, vgg, vgg_tiny). Fix: "
                          "pick one of the available ones, or add your own as DIR/recipe/NAME.yaml and run dapple-train --config-dir DIR recipe=NAME"),
        (["cluster=nope"], "Fix: pick one of the available ones, a file by path (cluster=/path/to/file.yaml)"),
        (["strategy.schedule=pipedream"], "expected one of [auto, dapple, gpipe, interleaved, zbv]. Fix: give strategy.schedule one of the values listed"),
        (["strategy.micro_batches=four"], "Fix: give strategy.micro_batches a value of the type its schema has"),
        (["strategy.micro_batches=["], "Fix: write each override as key=value"),
        (["+strategy.plan=auto"], "An item is already at 'strategy.plan'. Fix: drop the +"),
        (["ckpt_path=nowhere/last.ckpt"], "ckpt_path: 'nowhere/last.ckpt' is not a file. Fix: "),
        (["cluster=nowhere/mine.yaml"], "cluster: 'nowhere/mine.yaml' is not a file. Fix: give the path of a cluster YAML"),
        (["strategy.zero=3"], "zero: is 3. Fix: use"),
    ],
)
def test_bad_command_lines_are_one_line_with_a_fix(args, message, tmp_path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    code, _, err = _app_here(["recipe=bert_tiny", *args, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("dapple-train: error: ") and message in lines[0] and lines[0].count("Fix:") == 1, err
    assert not run_dir.exists()


def test_a_trainer_argument_outside_the_schema_reaches_the_trainer(tmp_path, monkeypatch) -> None:
    from lightning_dapple.app.config import compose_recipe

    cfg = compose_recipe("bert_tiny", ["strategy=single", "+trainer.gradient_clip_algorithm=value", "trainer.gradient_clip_val=1.0"])
    job = train.prepare(cfg, tmp_path)
    assert job.trainer.gradient_clip_algorithm == "value"


def _cluster_file(path: Path, memory: float) -> Path:
    text = (CONF / "cluster" / "local-cpu.yaml").read_text().replace("name: local-cpu", "name: mine").replace("device_memory_gib: 4.0", f"device_memory_gib: {memory}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_cluster_file_by_path_is_composed_like_a_preset(tmp_path, monkeypatch, capsys) -> None:
    mine = _cluster_file(tmp_path / "mine.yaml", 3.0)
    code, out, err = _app_here(["--cfg", "job", "recipe=bert_tiny", f"cluster={mine}"], monkeypatch, capsys)
    assert code == 0, err
    assert "name: mine" in out and "device_memory_gib: 3.0" in out and "devices_per_machine: ${trainer.devices}" in out
    # a file named like a packaged preset is the file, not the preset
    same_name = _cluster_file(tmp_path / "other" / "local-cpu.yaml", 1.5)
    code, out, err = _app_here(["--cfg", "job", "recipe=bert_tiny", f"cluster={same_name}"], monkeypatch, capsys)
    assert code == 0 and "device_memory_gib: 1.5" in out, err
    # keys the schema lacks are refused while composing, as for a preset
    (tmp_path / "typo.yaml").write_text("name: typo\ndevice_memory: 3\n")
    code, _, err = _app_here(["--cfg", "job", "recipe=bert_tiny", f"cluster={tmp_path / 'typo.yaml'}"], monkeypatch, capsys)
    assert code == 2 and "device_memory" in err and "Fix:" in err, err


def test_recipes_and_clusters_of_ones_own_through_config_dir(tmp_path, monkeypatch, capsys) -> None:
    _cluster_file(tmp_path / "cluster" / "mine.yaml", 2.5)
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "my_bert.yaml").write_text(
        (CONF / "recipe" / "bert_tiny.yaml").read_text().replace("name: bert_tiny", "name: my_bert").replace("max_steps: 300", "max_steps: 7")
    )
    code, out, err = _app_here(["--config-dir", str(tmp_path), "--cfg", "job", "recipe=my_bert", "cluster=mine"], monkeypatch, capsys)
    assert code == 0, err
    assert "name: my_bert" in out and "max_steps: 7" in out and "device_memory_gib: 2.5" in out


def test_more_cpu_processes_than_twice_the_cores_is_one_warning(tmp_path, monkeypatch, capsys) -> None:
    from lightning_dapple.app.config import compose_recipe

    many = 2 * usable_cores() + 1
    train._devices(compose_recipe("bert_tiny", [f"trainer.devices={many}"]), dapple=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dapple-train: warning: trainer.devices={many} starts {many} processes on {usable_cores()} CPU cores")
    train._devices(compose_recipe("bert_tiny", [f"trainer.devices={2 * usable_cores()}"]), dapple=True)
    assert capsys.readouterr().err == ""
