"""The executor against plain Lightning loops on one GPU, with the paper's models.

Runs ``bench_overhead.py --part single --device cuda`` for BERT-48 (DAPPLE Table 1: hidden
1024, 16 heads, 48 blocks; sequence 128, global batch 64) and VGG-19 (224 x 224 images,
1000 classes, global batch 128), in bf16 (``--precision``, default bf16-true), M = 4 for the
pipeline variants, one stage: plain, accumulate (M micro-batches, as Lightning's
``accumulate_grad_batches``), dapple M=1 and M, with ooo, with recompute="always"; each
variant timed alone with its peak allocated memory. Writes one JSON per model.

    python benchmarks/bench_gpu.py                         # both models -> benchmarks/results/gpu_*.json
    python benchmarks/bench_gpu.py --models bert --precision bf16-mixed
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_overhead  # noqa: E402

PRESETS = {
    "bert": ["--model", "bert", "--hidden", "1024", "--blocks", "48", "--heads", "16", "--seq", "128", "--vocab", "30522", "--batch", "64"],
    "vgg": ["--model", "vgg", "--width", "1", "--image", "224", "--fc", "4096", "--vocab", "1000", "--batch", "128"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=sorted(PRESETS))
    parser.add_argument("--precision", choices=("bf16-true", "bf16-mixed", "32-true"), default="bf16-true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    for model in args.models:
        out = args.out_dir / f"gpu_{model}_{args.precision}.json"
        bench_overhead.main([
            "--part", "single", "--device", "cuda", "--precision", args.precision, *PRESETS[model],
            "--rounds", str(args.rounds), "--block", str(args.block), "--out", str(out),
        ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
