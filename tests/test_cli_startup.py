"""The planner's command-line tools start without loading Lightning (or torch for --help),
and ``import lightning_dapple`` still registers the strategy whichever is imported first."""
from __future__ import annotations

import subprocess
import sys

import pytest

HELP = """
import sys
from lightning_dapple.cli import {cli} as cli
try:
    cli.main(["--help"])
except SystemExit as exc:
    assert exc.code == 0
print(sorted(name for name in ("torch", "lightning", "lightning.pytorch") if name in sys.modules))
"""

REGISTERED = """
{first}
{second}
from lightning.pytorch.strategies import StrategyRegistry
print("dapple" in StrategyRegistry and "dapple_spawn" in StrategyRegistry)
"""


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("cli", ["plan", "simulate", "profile"])
def test_help_loads_neither_lightning_nor_torch(cli: str) -> None:
    assert _run(HELP.format(cli=cli)) == "[]"


def test_dapple_plan_on_a_profile_never_loads_lightning(tmp_path) -> None:
    code = f"""
import sys
from lightning_dapple.cli.plan import main
main(["--profile", {str(_profile(tmp_path))!r}, "--cluster", "1x2", "--global-batch-size", "8"])
print("lightning" in sys.modules)
"""
    assert _run(code) == "False"


@pytest.mark.parametrize("lightning_first", [True, False])
def test_strategy_registered_whichever_is_imported_first(lightning_first: bool) -> None:
    ours, theirs = "import lightning_dapple", "import lightning.pytorch"
    first, second = (theirs, ours) if lightning_first else (ours, theirs)
    assert _run(REGISTERED.format(first=first, second=second)) == "True"


def _profile(tmp_path) -> object:
    from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile

    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 1e3, 1e4) for i in range(4))
    path = tmp_path / "profile.json"
    path.write_text(ModelProfile(micro_batch_size=1, layers=layers).to_json())
    return path


def test_a_module_of_ours_may_be_what_loads_lightning() -> None:
    """A spawned rank unpickles its launcher first, so a module of ours that imports
    Lightning can trigger the registration while it is itself half loaded."""
    code = """
import lightning_dapple
import lightning_dapple.strategy.reporting
from lightning.pytorch import Trainer
trainer = Trainer(strategy="dapple_spawn", accelerator="cpu", devices=1, logger=False)
print(type(trainer.strategy).__name__, trainer.strategy._start_method)
"""
    assert _run(code) == "DappleStrategy spawn"
