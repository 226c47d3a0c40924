"""dapple-plan: a plan for real profiles, JSON output, and one clear line for bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_dapple.cli.plan import main
from lightning_dapple.plan.plan import load_plan
from conftest import shared_profiles

SHARED = shared_profiles() / "dapple"


def _write(tmp_path: Path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


GOOD_PROFILE = {
    "micro_batch_size": 4,
    "layers": [
        {"name": f"l{i}", "forward_ms": 1.0, "backward_ms": 2.0, "output_bytes": 1e6, "param_bytes": 4e6, "stash_bytes": 2e6}
        for i in range(6)
    ],
}


def test_json_and_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    profile = _write(tmp_path, "p.json", GOOD_PROFILE)
    out = tmp_path / "plan.json"
    assert main(["--profile", profile, "--cluster", "1x4", "--global-batch-size", "32", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = load_plan(out)
    assert printed["stages"] == saved.to_dict()["stages"]
    assert saved.world_size == 4 and saved.num_layers == 6
    assert {"latency_ms", "pivot_stage", "memory_bytes"} <= set(printed["predicted"])


def test_table_names_the_reason(capsys: pytest.CaptureFixture) -> None:
    assert main(["--profile", str(SHARED / "vgg-19-pbs-32.txt"), "--cluster", "paper-c", "--global-batch-size", "2048"]) == 0
    text = capsys.readouterr().out
    assert "15:1" in text and "why:" in text  # DAPPLE Table 4: VGG-19 on config C


def _bad_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    good = _write(tmp_path, "good.json", GOOD_PROFILE)
    negative = dict(GOOD_PROFILE, layers=[dict(GOOD_PROFILE["layers"][0], forward_ms=-1.0)])
    incomplete = dict(GOOD_PROFILE, layers=[{"name": "x", "forward_ms": 1.0}])
    return [
        (["--profile", _write(tmp_path, "bad.json", "{not json"), "--cluster", "1x2", "--global-batch-size", "8"], "not valid JSON"),
        (["--profile", _write(tmp_path, "inc.json", incomplete), "--cluster", "1x2", "--global-batch-size", "8"], "backward_ms: is missing"),
        (["--profile", _write(tmp_path, "neg.json", negative), "--cluster", "1x2", "--global-batch-size", "8"], "is negative"),
        (["--profile", good, "--cluster", "0x4", "--global-batch-size", "8"], "cluster.machines"),
        (["--profile", good, "--cluster", _write(tmp_path, "c.json", {"machines": 1}), "--global-batch-size", "8"], "devices_per_machine: is missing"),
        (["--profile", good, "--cluster", "1x2", "--global-batch-size", "30", "--micro-batches", "7"], "cannot be split into 7"),
        (["--profile", good, "--cluster", "1x2", "--global-batch-size", "32", "--memory-gib", "0.001"], "no plan fits"),
        (["--profile", str(tmp_path / "missing.json"), "--cluster", "1x2", "--global-batch-size", "8"], "does not exist"),
        (["--profile", good, "--cluster", "nowhere", "--global-batch-size", "8"], "preset"),
        (["--profile", good, "--cluster", "1x2"], "--global-batch-size"),
    ]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for argv, fragment in _bad_cases(tmp_path):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, captured.err)
        assert fragment in lines[0], (fragment, lines[0])
        assert "Traceback" not in captured.err
