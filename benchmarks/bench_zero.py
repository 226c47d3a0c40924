"""Optimizer state and gradients per replica under ZeRO 0, 1 and 2 on a replicated stage.

Two CPU processes, one stage of eight ``nn.Linear(1024, 1024)`` layers replicated on both
(a data-parallel plan), AdamW, 3 steps. Each rank records the bytes of optimizer state it
holds (tensors in ``optimizer.state``), the bytes of gradients it holds when the optimizer
steps (``.grad`` of its parameters, after the replicas' reduction; the largest of the 3
steps) and its peak resident memory (``VmHWM``).

    python benchmarks/bench_zero.py          # writes benchmarks/results/zero.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS, WIDTH, WORLD = 8, 1024, 2


def _peak_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _train(zero: int, out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_dapple  # noqa: F401
    from lightning_dapple.strategy import DappleStrategy

    torch.set_num_threads(1)

    class Wide(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

        def forward(self, x):
            return self.layers(x)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Record(Callback):
        grad_bytes = 0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            held = sum(p.grad.numel() * p.grad.element_size() for p in pl_module.parameters() if p.grad is not None)
            self.grad_bytes = max(self.grad_bytes, held)

        def on_train_end(self, trainer, pl_module) -> None:
            state = sum(v.numel() * v.element_size() for opt in trainer.optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
            row = {"state_bytes": state, "grad_bytes": self.grad_bytes, "peak_mib": _peak_mib()}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))

    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, LAYERS], "devices": list(range(WORLD))}]}
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, WIDTH, generator=g), torch.randn(24, WIDTH, generator=g))
    Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=300, zero=zero), accelerator="cpu", devices=WORLD, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out), callbacks=[Record()],
    ).fit(Wide(), DataLoader(data, batch_size=8))


def _run(zero: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
        env["PYTHONWARNINGS"] = "ignore"
        subprocess.run([sys.executable, __file__, "--rank-run", str(zero), directory], check=True, env=env, stdout=subprocess.DEVNULL, timeout=900)
        return [json.loads((Path(directory) / f"rank{r}.json").read_text()) for r in range(WORLD)]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--rank-run":
        _train(int(sys.argv[2]), Path(sys.argv[3]))
        return
    rows = {f"zero={zero}": _run(zero) for zero in (0, 1, 2)}
    result = {"layers": LAYERS, "width": WIDTH, "world": WORLD, "per_rank": rows}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "zero.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, ranks in rows.items():
        print(f"{name}: " + "  ".join(
            f"rank {r}: state {d['state_bytes'] / 2**20:.1f} MiB, grads {d['grad_bytes'] / 2**20:.1f} MiB, peak {d['peak_mib']:.0f} MiB" for r, d in enumerate(ranks)
        ))


if __name__ == "__main__":
    main()
