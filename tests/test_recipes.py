"""dapple-train: Hydra recipes, the app's outputs, quality and equivalence, sweeps, bad input.

Multi-process runs go through the real console script in a subprocess (4 CPU processes,
forked by the app's launcher); single-device runs and bad-configuration checks call the
app in this process (no interpreter start-up). Budget on 2 cores: about 3-4 minutes.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lightning_dapple.app.config import compose_recipe, recipe_names
from lightning_dapple.cluster import PRESETS
from lightning_dapple.data import TINY_DATA_KWARGS
from lightning_dapple.models import PAPER_KWARGS, TINY_KWARGS

REPO = Path(__file__).resolve().parents[1]
# the console script of the interpreter running the tests (a venv's bin/ need not be on PATH)
_BESIDE = Path(sys.executable).parent / "dapple-train"
APP = str(_BESIDE) if _BESIDE.is_file() else shutil.which("dapple-train")
# Measured on 2 CPU cores with 4 processes under plan=auto (the single-device references of
# tests/test_models.py reach bert 0.34, gnmt ~1.0, vgg 0.98; the pipeline computes the same
# gradients). Thresholds sit well below, as in test_models (seed-dependent onsets).
QUALITY = {
    "bert_tiny": (300, "val_acc", 0.2),
    "gnmt_tiny": (300, "val_acc", 0.4),
    "vgg_tiny": (200, "val_acc", 0.5),
}
EQUIVALENT_STEPS = 20  # loss curves of dapple (4 processes) and one device agree this long
RUN_OUTPUTS = (
    "config.yaml",
    "dapple_plan.json",
    "dapple_plan.txt",
    "dapple_profile.json",
    "timeline_simulated.png",
    "timeline_measured.png",
    "timeline_measured.json",
    "metrics.csv",
    "step_times.json",
    "result.json",
)


def _app(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    assert APP is not None, "dapple-train is not installed (pip install -e .)"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)
    return subprocess.run([APP, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))


def _app_here(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Run ``dapple-train`` in this process: (exit code, stdout, stderr)."""
    from lightning_dapple.app import train

    # Hydra's logging set-up would point the root logger at pytest's capture buffers
    quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    monkeypatch.setattr(sys, "argv", ["dapple-train", *args, *quiet])
    code = 0
    try:
        train.main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _losses(run_dir: Path) -> list[float]:
    rows = [row for row in csv.DictReader(open(run_dir / "metrics.csv")) if row.get("train_loss")]
    return [float(row["train_loss"]) for row in sorted(rows, key=lambda r: int(r["step"]))]


# --------------------------------------------------------------------------- configuration


def test_recipes_compose_with_the_papers_sizes() -> None:
    assert recipe_names() == ["bert", "bert_pipeline_tiny", "bert_tiny", "gnmt", "gnmt_tiny", "vgg", "vgg_tiny"]
    gbs = {"bert": 64, "gnmt": 1024, "vgg": 2048}  # DAPPLE Table 4
    for name, batch in gbs.items():
        cfg = compose_recipe(name)
        model = dict(cfg.model)
        assert model.pop("name") == name
        assert {k: model[k] for k in PAPER_KWARGS[name]} == PAPER_KWARGS[name]
        assert cfg.data.batch_size == batch
        # this machine's GPUs (cluster=auto), one node unless told: not the paper's 2 x 8 V100
        assert (cfg.trainer.devices, cfg.trainer.num_nodes, cfg.cluster.name) == (8, 1, "auto")
    for name in ("bert", "gnmt", "vgg"):
        cfg = compose_recipe(f"{name}_tiny")
        model = dict(cfg.model)
        assert model.pop("name") == name
        assert model == TINY_KWARGS[name]
        data = dict(cfg.data)
        assert {k: data[k] for k in TINY_DATA_KWARGS[data.pop("name")]} == TINY_DATA_KWARGS[cfg.data.name]
        assert cfg.data.batch_size == 32 and cfg.trainer.devices == 4 and cfg.strategy.plan == "auto"
        assert cfg.cluster.name == "auto" and cfg.cluster.devices_per_machine == 4  # follows trainer.devices
    from lightning_dapple.app.train import _kwargs
    from lightning_dapple.data import DATAMODULES
    from lightning_dapple.models import MODELS

    for name in recipe_names():  # every option is a constructor argument
        cfg = compose_recipe(name)
        _kwargs(cfg.model, MODELS, "model")
        _kwargs(cfg.data, DATAMODULES, "data")
    for preset in ("paper-a", "paper-b", "paper-c"):
        cluster = dict(compose_recipe("bert", [f"cluster={preset}"]).cluster)
        assert cluster == PRESETS[preset].to_dict()


def test_configs_ship_in_the_package(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools")
    conf = REPO / "lightning_dapple" / "conf"
    assert (REPO / "conf").is_symlink() and (REPO / "conf").resolve() == conf.resolve()
    assert (REPO / "recipes").is_symlink() and (REPO / "recipes").resolve() == (conf / "recipe").resolve()
    wanted = {p.relative_to(REPO).as_posix() for p in conf.rglob("*.yaml")}
    assert len(wanted) > 20
    # build from a clean copy (a build/ folder left in the checkout could add stale files)
    source = tmp_path / "src"
    shutil.copytree(REPO / "lightning_dapple", source / "lightning_dapple", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        cwd=str(source), check=True, timeout=180, capture_output=True,
    )
    wheel = next(tmp_path.glob("lightning_dapple-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert wanted <= names, sorted(wanted - names)
    assert any(n.endswith("entry_points.txt") and "dapple-train" in zipfile.ZipFile(wheel).read(n).decode() for n in names)


def test_recipe_profile_shared_and_estimated() -> None:
    import torch

    from lightning_dapple.app.recipe_profile import recipe_global_batch, recipe_profile, shared_profile_path
    from lightning_dapple.models import paper_model

    assert [recipe_global_batch(n) for n in ("bert", "gnmt", "vgg")] == [64, 1024, 2048]
    for name in ("bert", "gnmt", "vgg"):
        estimate = recipe_profile(name, device="A100")  # no A100 profile is published: estimated
        assert estimate.estimated and "A100" in estimate.device
        with torch.device("meta"):
            assert estimate.num_layers == len(paper_model(name).layers)
        assert all(layer.forward_ms > 0 and layer.backward_ms >= layer.forward_ms for layer in estimate.layers[1:])
        if shared_profile_path(name) is not None:
            shared = recipe_profile(name)  # V100: the published profile
            assert not shared.estimated and shared.meta["source"].endswith(".txt")
    v100 = recipe_profile("bert", device="V100", prefer_shared=False)
    h100 = recipe_profile("bert", device="H100", prefer_shared=False)
    assert v100.estimated and sum(l.forward_ms for l in v100.layers) > 3 * sum(l.forward_ms for l in h100.layers)
    with pytest.raises(Exception, match="recipe"):
        recipe_profile("resnet")


# --------------------------------------------------------------------------- bad configuration


@pytest.mark.parametrize(
    "args, message",
    [
        (["recipe=nope"], "Could not find 'recipe/nope' (available: bert, bert_pipeline_tiny, bert_tiny"),
        (["strategy.micro_batch=4"], "Key 'micro_batch' not in 'StrategyConfig'"),
        (["strategy.micro_batches=four"], "could not be converted to Integer"),
        (["strategy.schedule=pipedream"], "expected one of [auto, dapple, gpipe, interleaved, zbv]"),
        (["strategy.micro_batches=5"], "strategy.micro_batches: 5 does not divide the global batch 32"),
        (["trainer.devices=5", "cluster=paper-b", "trainer.num_nodes=4"], "asks for 20 devices"),
        (["trainer.accelerator=gpu", "trainer.devices=64"], "asks for 64 GPUs"),
        (["+model.depth=3"], "model.depth: is not an option of BertMLM"),
    ],
)
def test_bad_configuration_is_one_line_and_leaves_no_run_dir(args, message, tmp_path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    code, out, err = _app_here(["recipe=bert_tiny", *args, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("dapple-train: error: ") and message in lines[0], err
    assert not run_dir.exists()


def test_bad_configuration_from_the_console_script(tmp_path) -> None:
    result = _app(["recipe=bert_tiny", "strategy.micro_batches=3", f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "dapple-train: error: strategy.micro_batches: 3 does not divide the global batch 32 (data.batch_size). "
        "Fix: use one of [1, 2, 4, 8, 16, 32]"
    ]
    assert not (tmp_path / "run").exists()


def _shape_file(path: Path, batch: int) -> Path:
    """A plan shape: four single-process stages, M=8, the layer cut left to the planner."""
    path.write_text(json.dumps({"global_batch_size": batch, "micro_batches": 8, "stages": [{"devices": [rank]} for rank in range(4)]}))
    return path


def test_a_plan_shape_file_is_checked_before_the_run(tmp_path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    shape = _shape_file(tmp_path / "shape.json", batch=64)
    code, _, err = _app_here(["recipe=vgg_tiny", f"strategy.plan={shape}", f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert code == 2 and "strategy.plan.global_batch_size: is 64 but data.batch_size is 32" in err, err
    assert not run_dir.exists()


@pytest.mark.timeout(300)
def test_a_plan_shape_file_is_cut_by_the_planner_and_trains(tmp_path: Path) -> None:
    """Stages given by their devices alone: the run profiles, cuts the layers for that shape
    and decides ooo by simulating it (on CPU processes sharing fewer cores, their compute)."""
    from lightning_dapple.cluster import usable_cores
    from lightning_dapple.strategy.ooo_choice import DEFERRED_LAYER_MS, MIN_GAIN

    run_dir = tmp_path / "run"
    shape = _shape_file(tmp_path / "shape.json", batch=32)
    result = _app(["recipe=vgg_tiny", f"strategy.plan={shape}", "trainer.max_steps=3", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((run_dir / "dapple_plan.json").read_text())
    assert [stage["devices"] for stage in plan["stages"]] == [[0], [1], [2], [3]] and plan["micro_batches"] == 8
    assert plan["stages"][0]["layers"][0] == 0 and plan["stages"][-1]["layers"][1] > plan["stages"][-1]["layers"][0]
    # the choice follows its own simulation; whether the shared cores or the bubbles set the
    # step depends on the profiled times, and a note about the cores names this machine's
    choice = plan["extra"]["ooo_choice"]
    found = re.fullmatch(r"(on|off) \(auto: simulated step ([\d.]+) ms with ooo, ([\d.]+) ms without(.*)\)", choice)
    assert found, choice
    with_ooo, without = float(found[2]), float(found[3])
    if abs(with_ooo - without * (1 - MIN_GAIN)) > 0.01:  # clear of the printed numbers' rounding
        assert (found[1] == "on") == (with_ooo < without * (1 - MIN_GAIN)), choice
    priced = f" (deferred weight gradients priced {DEFERRED_LAYER_MS:g} ms per layer of a stage)"
    cores = f" (4 CPU processes share {usable_cores()} cores: the step is their compute, which ooo's split backward adds to)"
    assert found[4] in ("", cores, priced, priced + cores), choice


# --------------------------------------------------------------------------- training


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", sorted(QUALITY))
def test_tiny_recipe_trains_and_matches_one_device(recipe: str, tmp_path: Path, monkeypatch, capsys) -> None:
    steps, metric, threshold = QUALITY[recipe]
    run_dir = tmp_path / "dapple"
    result = _app([f"recipe={recipe}", f"hydra.run.dir={run_dir}", "trainer.enable_progress_bar=false"], timeout=420)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in RUN_OUTPUTS:
        assert (run_dir / name).is_file(), name
    record = json.loads((run_dir / "result.json").read_text())
    plan = json.loads((run_dir / "dapple_plan.json").read_text())
    print(f"\n{recipe}: plan {record['plan']['kind']} M={plan['micro_batches']}, {record['steps']} steps, "
          f"median step {record['median_step_ms']:.1f} ms, {metric} {record['metrics'][metric]:.3f}, fit {record['wall_s']} s")
    assert plan["planner"] != "manual" and sum(len(s["devices"]) for s in plan["stages"]) == 4  # plan=auto
    # ooo=auto was decided by simulating the plan on its measured profile, and says so
    assert plan["extra"]["ooo_choice"] == ("on" if plan["ooo"] else "off") + plan["extra"]["ooo_choice"][len("on" if plan["ooo"] else "off"):]
    assert "simulated step" in plan["extra"]["ooo_choice"] or len(plan["stages"]) == 1
    assert record["steps"] == steps and record["metrics"][metric] > threshold
    losses = record["train_loss_curve"]
    assert len(losses) == steps and sum(losses[-10:]) / 10 < 0.8 * sum(losses[:5]) / 5
    assert record["peak_stash_bytes"] > 0 and record["median_step_ms"] > 0
    # the executor's own step is a part of the training step Lightning times around it
    phases = record["median_phase_ms"]
    assert 0 < phases["executor"] <= phases["pipeline"] < record["median_step_ms"]
    # every rank's peak memory, gathered to rank 0: on the CPU the process's resident set
    assert len(record["peak_memory_bytes_per_rank"]) == 4 and min(record["peak_memory_bytes_per_rank"]) > 50 << 20
    assert record["peak_memory_kind"].startswith("process peak resident set")
    # the recipe's step around the layers (its loss, logging and accuracy metric) was timed at set-up
    glue = json.loads((run_dir / "dapple_profile.json").read_text())["step_glue_ms"]
    assert glue["loss_forward"] > 0 and glue["loss_backward"] > 0
    measured = json.loads((run_dir / "timeline_measured.json").read_text())
    assert len(measured["ranks"]) == 4 and all(r["spans"] for r in measured["ranks"].values())
    assert "stage" in (run_dir / "dapple_plan.txt").read_text()
    # cluster=auto: planned for this machine, 4 CPU processes sharing its memory, with its
    # links measured on the run's processes before planning; and the plan says so
    from lightning_dapple.cluster import detect_cluster

    measured_links = ("latency_ms", "allreduce_latency_ms", "allreduce_latency_per_rank_ms", "intra_bandwidth_gbps")
    detected = detect_cluster(1, 4, "cpu").to_dict()
    assert {k: v for k, v in plan["extra"]["cluster"].items() if k not in measured_links} == {k: v for k, v in detected.items() if k not in measured_links}
    assert plan["extra"]["cluster"]["allreduce_latency_ms"] > 0 and plan["extra"]["cluster"]["latency_ms"] > 0
    # and each layer's optimizer step, timed with the recipe's own optimizer
    profile = json.loads((run_dir / "dapple_profile.json").read_text())
    assert not profile["meta"]["optimizer"].startswith("not measured")
    assert all(layer.get("optimizer_ms", 0) > 0 for layer in profile["layers"])

    # The same recipe on one device, plain Lightning: the same loss curve (dropout 0).
    single = tmp_path / "single"
    code, _, err = _app_here(
        [f"recipe={recipe}", "strategy=single", f"trainer.max_steps={EQUIVALENT_STEPS}", f"hydra.run.dir={single}", "trainer.enable_progress_bar=false"],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    reference = _losses(single)
    assert len(reference) == EQUIVALENT_STEPS
    assert losses[:EQUIVALENT_STEPS] == pytest.approx(reference, abs=2e-4, rel=1e-4)


@pytest.mark.timeout(600)
def test_sweep_runs_four_plans_and_summarises(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = _app(
        ["-m", "recipe=vgg_tiny", "strategy.schedule=dapple,gpipe", "strategy.micro_batches=4,8", "strategy.ooo=false", "strategy.policy=PA",
         "trainer.max_steps=10", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={sweep}"],
        timeout=420,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sweep summary" in result.stdout
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert len(rows) == 4
    seen = set()
    for row in rows:
        run_dir = Path(row["run_dir"])
        plan = json.loads((run_dir / "dapple_plan.json").read_text())
        assert (run_dir / "metrics.csv").is_file() and (run_dir / "config.yaml").is_file()
        assert row["status"] == "ok" and float(row["median_step_ms"]) > 0 and int(row["peak_stash_bytes"]) > 0
        assert 0 < float(row["executor_step_ms"]) < float(row["median_step_ms"])  # the executor's part of the step
        assert (plan["schedule"], plan["micro_batches"]) == (row["schedule"], int(row["micro_batches"]))
        assert plan["ooo"] is False  # strategy.ooo=false reaches the strategy and its plan
        seen.add((plan["schedule"], plan["micro_batches"]))
    assert seen == {("dapple", 4), ("dapple", 8), ("gpipe", 4), ("gpipe", 8)}
    # schedules and micro-batch counts change the timing, never the gradients
    curves = [_losses(Path(row["run_dir"])) for row in rows]
    for curve in curves[1:]:
        assert curve == pytest.approx(curves[0], abs=2e-4)
    # GPipe keeps every micro-batch's activations, DAPPLE at most K_i of them (P_A's: with
    # policy auto the planner may buy speed with P_B's deeper warm-up)
    stash = {(r["schedule"], int(r["micro_batches"])): int(r["peak_stash_bytes"]) for r in rows}
    assert stash[("gpipe", 8)] > stash[("dapple", 8)]


@pytest.mark.timeout(600)
def test_a_sweep_over_two_recipes_writes_one_summary(tmp_path: Path) -> None:
    """``-m recipe=a,b`` with the configured sweep layout (no ``hydra.sweep.dir`` given): both
    jobs land in one ``multirun/<time>/`` and its one summary lists both, each with its
    measured and simulated step."""
    from lightning_dapple.app.summary import ranking_note

    assert APP is not None, "dapple-train is not installed (pip install -e .)"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)
    result = subprocess.run(
        [APP, "-m", "recipe=bert_tiny,gnmt_tiny", "trainer.devices=2", "trainer.max_steps=3", "outputs.warmup_steps=1",
         "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "outputs.measured_timeline=false", "outputs.plan_table=false"],
        check=False, capture_output=True, text=True, timeout=420, env=env, cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    sweeps = list((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 1, sweeps
    sweep = sweeps[0]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0_bert_tiny", "1_gnmt_tiny"]
    rows = list(csv.DictReader((sweep / "summary.csv").read_text().splitlines()))
    assert [(row["job"], row["overrides"], row["status"]) for row in rows] == [("0", "recipe=bert_tiny", "ok"), ("1", "recipe=gnmt_tiny", "ok")]
    for row in rows:
        assert Path(row["run_dir"]).parent.resolve() == sweep.resolve()
        measured, simulated = float(row["median_step_ms"]), float(row["simulated_step_ms"])
        assert measured > 0 and simulated > 0
        assert float(row["measured_over_simulated"]) == pytest.approx(measured / simulated, abs=0.01, rel=0.01)  # of the unrounded figures
    # the sentence under the table follows the rule on the figures the table shows
    typed = [{**row, "median_step_ms": float(row["median_step_ms"]), "simulated_step_ms": float(row["simulated_step_ms"])} for row in rows]
    note = ranking_note(typed)
    text = (sweep / "summary.txt").read_text()
    assert "step ms (simulated)" in text
    assert (note is not None) == ("The simulator ranks" in text)


@pytest.mark.timeout(600)
def test_a_sweep_compares_tuned_and_untuned_runs(tmp_path: Path) -> None:
    """``-m strategy.tune_steps=0,1``: the tuned job's plan carries its measured choice and the
    summary's ``tuning`` column says what tuning kept; the untuned job's says nothing."""
    assert APP is not None, "dapple-train is not installed (pip install -e .)"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)
    result = subprocess.run(
        [APP, "-m", "recipe=gnmt_tiny", "strategy.tune_steps=0,1", f"strategy.profile_cache={tmp_path / 'cache'}", "trainer.devices=2",
         "trainer.max_steps=3", "outputs.warmup_steps=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
         "outputs.measured_timeline=false", "outputs.plan_table=false"],
        check=False, capture_output=True, text=True, timeout=420, env=env, cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (sweep,) = list((tmp_path / "multirun").iterdir())
    rows = list(csv.DictReader((sweep / "summary.csv").read_text().splitlines()))
    assert [row["overrides"] for row in rows] == ["strategy.tune_steps=0", "strategy.tune_steps=1"]
    tuned_plan = json.loads((Path(rows[1]["run_dir"]) / "dapple_plan.json").read_text())
    record = tuned_plan["extra"]["tuning"]
    assert rows[0]["tuning"] == "" and "tuning" not in json.loads((Path(rows[0]["run_dir"]) / "dapple_plan.json").read_text())["extra"]
    assert rows[1]["tuning"] == (f"kept {record['chosen']}" if record["chosen"] == record["simulator_choice"] else f"measured {record['chosen']} over {record['simulator_choice']}")
    assert len(list((tmp_path / "cache").glob("tuning-*.json"))) == 1
