"""dapple-plan, the cases tests/test_plan_cli.py leaves out: graph-text input (negative
times, unknown batch size), a global batch below the slice floor, zero devices from a file,
unknown recipes, the PipeDream planner's JSON, and --out without --json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_dapple.cli.plan import main
from lightning_dapple.plan.plan import load_plan

NODE = "node{i} -- layer{i} -- forward_compute_time={f}, backward_compute_time=2.0, activation_size=1000.0, parameter_size=4000.0"


def _graph(tmp_path: Path, name: str, forward: str = "1.0", layers: int = 6) -> str:
    lines = [NODE.format(i=i, f=forward if i == 2 else "1.0") for i in range(1, layers + 1)]
    lines += [f"\tnode{i} -- node{i + 1}" for i in range(1, layers)]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("negative", "is negative"),
        ("no-batch-size", "profile batch size is unknown"),
        ("tiny-batch", "cannot be split into micro-batches of at least 4"),
        ("zero-devices", "cluster.devices_per_machine"),
        ("recipe", "is not a recipe"),
        ("micro-batches", "cannot be split into 3"),
    ],
)
def test_bad_input_one_line_exit_2(case: str, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = _graph(tmp_path, "model-pbs-4.txt")
    argv = {
        "negative": ["--profile", _graph(tmp_path, "neg-pbs-4.txt", forward="-3.0"), "--cluster", "1x2", "--global-batch-size", "16"],
        "no-batch-size": ["--profile", _graph(tmp_path, "model.txt"), "--cluster", "1x2", "--global-batch-size", "16"],
        "tiny-batch": ["--profile", good, "--cluster", "1x2", "--global-batch-size", "2"],
        "zero-devices": ["--profile", good, "--cluster", str(_zero(tmp_path)), "--global-batch-size", "16"],
        "recipe": ["--recipe", "no-such-model", "--cluster", "paper-a"],
        "micro-batches": ["--profile", good, "--cluster", "1x2", "--global-batch-size", "16", "--micro-batches", "3"],
    }[case]
    assert main(argv) == 2
    assert fragment in _one_error_line(capsys)


def _zero(tmp_path: Path) -> Path:
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"machines": 1, "devices_per_machine": 0}))
    return path


def test_pipedream_json_and_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    profile = _graph(tmp_path, "model-pbs-4.txt", layers=8)
    out = tmp_path / "nested" / "plan.json"
    assert main(["--profile", profile, "--cluster", "2x2", "--global-batch-size", "64", "--planner", "pipedream", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["planner"] == "pipedream" and sum(len(s["devices"]) for s in data["stages"]) == 4
    assert main(["--profile", profile, "--cluster", "2x2", "--global-batch-size", "64", "--out", str(out), "--schedule", "gpipe"]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert plan.schedule == "gpipe" and plan.world_size == 4 and plan.num_layers == 8
    assert str(out) in text


def test_zero_shards_every_replicated_stage_and_needs_dapples_planner(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = _graph(tmp_path, "model-pbs-4.txt")
    assert main(["--profile", good, "--cluster", "1x4", "--global-batch-size", "64", "--zero", "1", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert any(len(stage["devices"]) > 1 for stage in stages)
    assert [stage.get("zero", 0) for stage in stages] == [1 if len(stage["devices"]) > 1 else 0 for stage in stages]
    assert main(["--profile", good, "--cluster", "1x4", "--global-batch-size", "64", "--zero", "1", "--planner", "pipedream"]) == 2
    assert "--zero: is 1 with --planner pipedream. Fix: use --zero with DAPPLE's planner" in _one_error_line(capsys)
