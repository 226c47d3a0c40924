"""Tables read in full wherever the output goes: piped into another program, written to a
file or a CI log, every header and number of the command lines' and the app's tables is
printed whole (``plan.console``); on a terminal rich keeps the terminal's width."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table

from conftest import shared_profiles
from lightning_dapple.plan.console import UNBOUNDED_COLUMNS, make_console, render_text

RESNET50 = shared_profiles() / "pipedream" / "resnet50.graph.txt"
FLAT_16 = {"name": "flat-16", "machines": 16, "devices_per_machine": 1, "inter_bandwidth_gbps": 200.0}
PLAN_HEADERS = ("stage", "layers", "first .. last layer", "devices", "F ms", "B ms", "send ms", "AllReduce ms (exposed)", "optimizer ms", "memory/device", "recompute")
SIMULATE_HEADERS = ("stage", "layers", "devices", "K_i", "F ms", "B ms", "send ms", "AR ms (exposed)", "recompute", "peak", "stash MB", "busy %")
ELLIPSIS = "\u2026"


def _piped(module: str, *args: str, columns: str | None = None) -> str:
    """Standard output of ``python -m module args`` read through a pipe, as ``| cat`` sees it."""
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}
    if columns is not None:
        env["COLUMNS"] = columns
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict]:
    """dapple-plan's arguments for ResNet-50 on 16 flat workers (a 7-stage plan, a wide
    table) and the plan JSON it writes."""
    folder = tmp_path_factory.mktemp("plan")
    cluster = folder / "flat-16.json"
    cluster.write_text(json.dumps(FLAT_16))
    out = folder / "plan.json"
    args = ["--profile", str(RESNET50), "--profile-batch-size", "64", "--cluster", str(cluster), "--global-batch-size", "1024", "--planner", "pipedream"]
    _piped("lightning_dapple.cli.plan", *args, "--json", "--out", str(out))
    return args, json.loads(out.read_text())


@pytest.mark.parametrize("columns", [None, "40"])
def test_dapple_plan_through_a_pipe_prints_every_header_and_number(planned: tuple[list[str], dict], columns: str | None) -> None:
    args, plan = planned
    text = _piped("lightning_dapple.cli.plan", *args, columns=columns)
    assert ELLIPSIS not in text
    for header in PLAN_HEADERS:
        assert f" {header} " in text, header
    rows = [line for line in text.splitlines() if line.startswith("\u2502")]
    assert len(rows) == len(plan["stages"])  # one line per stage: no cell wrapped
    for row, stage in zip(rows, plan["stages"]):
        assert f"[{stage['layers'][0]}, {stage['layers'][1]})" in row
    simulated = plan["predicted"]["simulated_latency_ms"]
    assert f"simulated latency {simulated:.1f} ms" in text
    assert plan["reason"] in text  # the reason whole, on one line


def test_dapple_simulate_through_a_pipe_prints_every_header(planned: tuple[list[str], dict], tmp_path: Path) -> None:
    args, plan = planned
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    text = _piped(
        "lightning_dapple.cli.simulate", "--profile", str(RESNET50), "--profile-batch-size", "64", "--cluster", args[args.index("--cluster") + 1],
        "--plan", str(path), columns="40",
    )
    assert ELLIPSIS not in text
    for header in SIMULATE_HEADERS:
        assert f" {header} " in text, header
    assert f"latency: {plan['predicted']['simulated_latency_ms']:.3f} ms per step" in text


def _wide_table() -> Table:
    table = Table(title="a table wider than any terminal default")
    for index in range(12):
        table.add_column(f"column number {index}")
    table.add_row(*(f"{10 ** 15 + index}" for index in range(12)))
    return table


def test_the_app_s_tables_print_whole_into_a_pipe() -> None:
    """make_console on standard output, as the app's run and sweep summaries use it."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_cli_output import _wide_table; "
        "from lightning_dapple.plan.console import make_console; make_console().print(_wide_table())"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env["COLUMNS"] = "60"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120, env=env, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ELLIPSIS not in result.stdout
    for index in range(12):
        assert f" column number {index} " in result.stdout and f" {10 ** 15 + index} " in result.stdout


def test_text_written_beside_a_run_is_whole() -> None:
    text = render_text(_wide_table())
    assert ELLIPSIS not in text and all(f" {10 ** 15 + index} " in text for index in range(12))
    assert "\x1b[" not in text  # no colour codes in files


def test_a_terminal_keeps_its_width() -> None:
    primary, secondary = os.openpty()
    try:
        with open(secondary, "w", closefd=False) as tty:
            assert make_console(tty).width < UNBOUNDED_COLUMNS
    finally:
        os.close(primary)
        os.close(secondary)
