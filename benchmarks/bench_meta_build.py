"""Peak memory per rank when a model larger than one process is made in ``configure_model``.

Four CPU processes, eight ``nn.Linear(4096, 4096)`` layers (64 MiB of float32 weights each,
512 MiB in all), a 4-stage plan of two layers per stage, SGD. Each rank records its peak
resident memory (``VmHWM``) after the last training step, before anything is gathered back
after ``fit``. Three runs: a tiny model of the same shape of plan (the baseline: the
process, torch and Lightning), the large model with ``meta_init=True`` (built on the meta
device, each rank makes its stage: ``strategy/meta_build.py``) and with ``meta_init=False``
(every rank builds the whole model on the CPU, then frees the other stages).

    python benchmarks/bench_meta_build.py            # all three runs, writes benchmarks/results/meta_build.json
    python benchmarks/bench_meta_build.py --hf       # a Hugging Face Llama, writes benchmarks/results/meta_build_hf.json

The target: every rank's peak above the baseline is at most 1.3x its stage's weights plus
gradients (2 x 128 MiB).

``--hf``: a Llama of eight blocks (hidden 1024, 51 MiB of float32 weights per block) saved
with ``save_pretrained``, on a 4-stage plan of two blocks each (the embedding with the first
stage, the head with the last), SGD, 3 steps. Two ways of loading it: ``from_pretrained`` in
``__init__`` (every rank loads the whole model, then frees the other stages) and
``from_config`` in ``configure_model`` with ``DappleStrategy(pretrained=directory)`` (each
rank reads its own stage's tensors only, ``strategy/hf_weights.py``); the baseline is the
second way with a 64-wide model.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS, WORLD = 8, 4
MIB = 2**20


def _peak_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _train(width: int, meta_init: bool, out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_dapple  # noqa: F401
    from lightning_dapple.strategy import DappleStrategy

    torch.set_num_threads(1)

    class Wide(LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "layers"):
                self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])

        def forward(self, x):
            return self.layers(x)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Peak(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.setup_mib = _peak_mib()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == trainer.max_steps:
                peaks = {"peak_mib": _peak_mib(), "setup_peak_mib": self.setup_mib}
                (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(peaks))

    per_stage = LAYERS // WORLD
    plan = {
        "global_batch_size": 4, "micro_batches": int(os.environ.get("BENCH_M", "2")),
        "stages": [{"layers": [s * per_stage, (s + 1) * per_stage], "devices": [s]} for s in range(WORLD)],
    }
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(12, width, generator=g), torch.randn(12, width, generator=g))
    Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=300, meta_init=meta_init, ooo=os.environ.get("BENCH_OOO", "auto")), accelerator="cpu", devices=WORLD, max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(out), callbacks=[Peak()],
    ).fit(Wide(), DataLoader(data, batch_size=4))


def _train_hf(checkpoint: Path, on_meta: bool, out: Path) -> None:
    """A Hugging Face Llama from ``checkpoint``: ``from_pretrained`` in ``__init__``, or
    ``from_config`` in ``configure_model`` with ``DappleStrategy(pretrained=...)``."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_dapple  # noqa: F401
    from lightning_dapple.strategy import DappleStrategy

    torch.set_num_threads(1)

    class LitLlama(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if not on_meta:
                self.model = AutoModelForCausalLM.from_pretrained(checkpoint)

        def configure_model(self) -> None:
            if on_meta and not hasattr(self, "model"):
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))

        def forward(self, input_ids, labels=None):
            return self.model(input_ids=input_ids, labels=labels)

        def training_step(self, batch, batch_idx):
            return self(batch["input_ids"], batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Peak(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.setup_mib = _peak_mib()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == trainer.max_steps:
                (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"peak_mib": _peak_mib(), "setup_peak_mib": self.setup_mib}))

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 1024, (4, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [a, b], "devices": [s]} for s, (a, b) in enumerate([(0, 3), (3, 5), (5, 7), (7, 10)])]}
    strategy = DappleStrategy(plan=plan, timeout_s=300, pretrained=str(checkpoint) if on_meta else None)
    Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out), callbacks=[Peak()],
    ).fit(LitLlama(), torch.utils.data.DataLoader(batches, batch_size=None))


def _save_llama(hidden: int, directory: Path) -> float:
    """A Llama of ``LAYERS`` blocks saved in ``directory``; returns one block's MiB."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=LAYERS, num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.model.layers[0].parameters()) * 4 / MIB


def _run(*args: str, label: str) -> list[float]:
    """The per-rank peaks of one launch (Lightning's subprocess launcher re-runs this file)."""
    with tempfile.TemporaryDirectory() as directory:
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
        env["PYTHONWARNINGS"] = "ignore"
        subprocess.run(
            [sys.executable, __file__, "--rank-run", *args, directory], check=True, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900,
        )
        peaks = [json.loads((Path(directory) / f"rank{r}.json").read_text()) for r in range(WORLD)]
        print(f"{label}: peak at the end of set-up " + ", ".join(f"{p['setup_peak_mib']:.0f}" for p in peaks) + " MiB")
        return [p["peak_mib"] for p in peaks]


def _main_hf() -> None:
    with tempfile.TemporaryDirectory() as directory:
        tiny, large = Path(directory) / "tiny", Path(directory) / "large"
        _save_llama(64, tiny)
        block_mib = _save_llama(1024, large)
        stage_mib = 2 * 2 * block_mib  # two blocks, weights + gradients
        baseline = _run("hf", str(tiny), "1", label="baseline (64-wide)")
        rows = {
            "baseline": baseline,
            "pretrained= on meta": _run("hf", str(large), "1", label="from_config in configure_model + pretrained="),
            "from_pretrained in __init__": _run("hf", str(large), "0", label="from_pretrained in __init__"),
        }
    print(f"one block: {block_mib:.1f} MiB")
    _report(rows, stage_mib, "meta_build_hf.json", {"hidden": 1024, "blocks": LAYERS, "world": WORLD, "block_mib": block_mib})


def _report(rows: dict[str, list[float]], stage_mib: float, file_name: str, setting: dict) -> None:
    """Write each run's peak per rank, and its peak above the baseline's over the stage's
    weights plus gradients, to ``results/file_name``, and print both."""
    baseline = rows["baseline"]
    result = {
        **setting, "stage_weights_and_grads_mib": stage_mib, "peak_mib": rows,
        "above_baseline_over_stage": {
            name: [round((peak - base) / stage_mib, 3) for peak, base in zip(peaks, baseline)] for name, peaks in rows.items() if name != "baseline"
        },
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / file_name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"stage weights + gradients: {stage_mib:.0f} MiB")
    width = max(len(name) for name in rows)
    for name, peaks in rows.items():
        print(f"{name:>{width}}: " + "  ".join(f"rank {r} {p:6.0f} MiB" for r, p in enumerate(peaks)))
    for name, ratios in result["above_baseline_over_stage"].items():
        print(f"{name:>{width}}: peak above baseline / stage = " + ", ".join(f"{r:.2f}" for r in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--hf", action="store_true", help="a Hugging Face Llama from a save_pretrained directory")
    parser.add_argument("--rank-run", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run and args.rank_run[0] == "hf":
        _, checkpoint, meta, directory = args.rank_run
        _train_hf(Path(checkpoint), bool(int(meta)), Path(directory))
        return
    if args.rank_run:
        width, meta, directory = args.rank_run
        _train(int(width), bool(int(meta)), Path(directory))
        return
    if args.hf:
        _main_hf()
        return
    stage_mib = 2 * (LAYERS // WORLD) * (args.width * args.width + args.width) * 4 / MIB  # weights + gradients
    baseline = _run("64", "1", label="width 64 meta_init=True")
    rows = {
        "baseline": baseline,
        "meta_init=True": _run(str(args.width), "1", label=f"width {args.width} meta_init=True"),
        "meta_init=False": _run(str(args.width), "0", label=f"width {args.width} meta_init=False"),
    }
    _report(rows, stage_mib, "meta_build.json", {"width": args.width, "layers": LAYERS, "world": WORLD})


if __name__ == "__main__":
    main()
