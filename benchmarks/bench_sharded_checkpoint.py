"""Rank 0's memory during a checkpoint save: consolidated file against sharded directory.

Four CPU processes (gloo) train a model of eight ``nn.Linear(2048, 2048)`` layers (16 MiB
of weights each in float32, Adam) on a 4-stage plan, two layers a stage, for one step, then
save a checkpoint with ``trainer.save_checkpoint`` once under ``checkpoint="consolidated"``
and once under ``checkpoint="sharded"`` (a fresh job each). Around the save every rank
resets its peak resident set (``/proc/self/clear_refs``, 5) and reads ``VmHWM`` after it;
the increase over ``VmRSS`` before the save is what the save cost that rank's host memory.
The files written and their sizes are listed too. ::

    python benchmarks/bench_sharded_checkpoint.py --out benchmarks/results/sharded_checkpoint.json

A consolidated save gathers every stage's weights and Adam state on rank 0 before it writes
one file, so rank 0's peak grows by the other stages' share of the checkpoint; under
"sharded" each stage leader writes its own stage and rank 0's peak should stay below the
size of the model's weights alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_dapple.strategy import DappleStrategy  # noqa: E402

WIDTH = 2048
LAYERS = 8
RANKS = 4
PLAN = {
    "global_batch_size": 8,
    "micro_batches": 4,
    "stages": [{"layers": [2 * i, 2 * i + 2], "devices": [i]} for i in range(RANKS)],
}
MIB = 1024 * 1024


class Wide(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class MeasureSave(Callback):
    """After training, every rank saves ``path`` with its peak RSS reset just before."""

    def __init__(self, path: str, out: str) -> None:
        self.path = path
        self.out = out

    def setup(self, trainer, pl_module, stage) -> None:
        torch.set_num_threads(1)

    def on_train_end(self, trainer, pl_module) -> None:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        trainer.save_checkpoint(self.path)
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM")
        record = {"rank": trainer.global_rank, "rss_before_mib": before / 1024, "peak_increase_mib": (peak - before) / 1024, "save_s": seconds}
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _files(path: Path) -> dict[str, float]:
    if path.is_file():
        return {path.name: path.stat().st_size / MIB}
    return {p.name: p.stat().st_size / MIB for p in sorted(path.iterdir())}


def measure(mode: str, root: Path) -> dict:
    target = root / f"{mode}.ckpt"
    out = root / mode
    out.mkdir()
    data = TensorDataset(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    trainer = Trainer(
        strategy=DappleStrategy(plan=PLAN, start_method="spawn", timeout_s=300, checkpoint=mode),
        accelerator="cpu", devices=RANKS, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        callbacks=[MeasureSave(str(target), str(out))],
    )
    trainer.fit(Wide(), DataLoader(data, batch_size=8))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return {"ranks": ranks, "files_mib": _files(target)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    weights = LAYERS * (WIDTH * WIDTH + WIDTH) * 4 / MIB
    results = {
        "ranks": RANKS,
        "layers": f"{LAYERS} x nn.Linear({WIDTH}, {WIDTH}), float32, Adam",
        "plan": "4 stages of 2 layers, one rank each",
        "model_weights_mib": weights,
        "checkpoint_tensors_mib": 3 * weights,  # weights, exp_avg, exp_avg_sq
        "cpu_count": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("consolidated", "sharded"):
            results[mode] = measure(mode, Path(tmp))
            rank0 = results[mode]["ranks"][0]
            print(f"{mode}: rank 0 peak +{rank0['peak_increase_mib']:.1f} MiB during the save ({rank0['save_s']:.2f} s); "
                  f"files {results[mode]['files_mib']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
