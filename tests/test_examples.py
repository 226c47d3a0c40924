"""The example the README links runs as a newcomer runs it: a first fit on two processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


@pytest.mark.timeout(300)
def test_the_readme_example_trains_on_two_processes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--devices", "2", "--steps", "4"], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final train_loss" in result.stdout, result.stdout[-2000:]
    assert list(tmp_path.glob("outputs/quickstart/lightning_logs/version_*/dapple_plan.json"))
