"""Every tool's --help reads as plain text: no reStructuredText left from the docstrings it is
made of, an "Examples:" epilog on the argparse tools, and help text on every option."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = {"dapple-plan": "lightning_dapple.cli.plan", "dapple-simulate": "lightning_dapple.cli.simulate", "dapple-profile": "lightning_dapple.cli.profile"}
RST = ("``", ":func:", ":class:", ":meth:", ":mod:")


def _help(module: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "100"})
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_is_plain_text_with_examples(tool: str) -> None:
    text = _help(TOOLS[tool])
    assert text.startswith(f"usage: {tool} ")
    for artifact in RST:
        assert artifact not in text, f"{tool} --help shows {artifact!r}"
    examples = text[text.index("\nExamples:\n") :]
    assert examples.count(f"  {tool} ") >= 2  # a few command lines to copy


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_option_has_help(tool: str) -> None:
    parser = importlib.import_module(TOOLS[tool]).build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help != argparse.SUPPRESS and len(action.help) > 10, f"{tool} {action.option_strings} has no help"


@pytest.mark.parametrize("tool", ["dapple-plan", "dapple-simulate"])
def test_one_vocabulary_for_schedule_ooo_and_cluster(tool: str) -> None:
    """--schedule and --ooo take what DappleStrategy takes; --cluster is worded alike."""
    from lightning_dapple.cli.common import CLUSTER_HELP
    from lightning_dapple.plan.plan import SCHEDULES

    options = {option: action for action in importlib.import_module(TOOLS[tool]).build_parser()._actions for option in action.option_strings}
    assert tuple(options["--schedule"].choices) == ("auto", *SCHEDULES)
    assert tuple(options["--ooo"].choices) == ("auto", "true", "false") and options["--ooo"].const == "true"
    assert options["--cluster"].help == CLUSTER_HELP


def test_dapple_train_help_is_plain_text() -> None:
    app = Path(sys.executable).parent / "dapple-train"
    command = [str(app)] if app.is_file() else [sys.executable, "-m", "lightning_dapple.app.train"]
    result = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dapple-train recipe=" in result.stdout
    for artifact in RST:
        assert artifact not in result.stdout


def test_simulate_chooses_the_schedule_and_ooo_as_the_planner_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dapple-simulate --schedule auto --ooo auto on the planner's one-schedule plan ends where
    dapple-plan's defaults (schedule auto, ooo auto) end; --recipe stands in for --profile."""
    from lightning_dapple.cli.plan import main as plan_main
    from lightning_dapple.cli.simulate import main as simulate_main

    base = tmp_path / "dapple.json"
    assert plan_main(["--recipe", "bert", "--cluster", "paper-a", "--schedule", "dapple", "--ooo", "false", "--out", str(base), "--json"]) == 0
    capsys.readouterr()
    assert plan_main(["--recipe", "bert", "--cluster", "paper-a", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert simulate_main(["--recipe", "bert", "--plan", str(base), "--cluster", "paper-a", "--schedule", "auto", "--ooo", "auto", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["schedule"] == chosen["schedule"] and simulated["ooo"] == chosen["ooo"]
    assert simulated["latency_ms"] == pytest.approx(chosen["predicted"]["simulated_latency_ms"], rel=1e-9)
    assert simulated["ooo_choice"] == chosen["extra"]["ooo_choice"]
    # a plan whose schedule was chosen already is not chosen again
    chunked = tmp_path / "chunked.json"
    chunked.write_text(json.dumps(chosen))
    assert simulate_main(["--recipe", "bert", "--plan", str(chunked), "--cluster", "paper-a", "--schedule", "auto"]) == 2
    assert "--schedule: is auto but the plan runs" in capsys.readouterr().err
    # --ooo false turns off what the plan has; --ooo alone is true
    assert simulate_main(["--recipe", "bert", "--plan", str(base), "--cluster", "paper-a", "--ooo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ooo"] is True
    assert simulate_main(["--recipe", "bert", "--plan", str(base), "--cluster", "paper-a", "--ooo", "maybe"]) == 2
    assert capsys.readouterr().err.startswith("error: argument --ooo: invalid choice")

