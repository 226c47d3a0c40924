"""dapple-profile: measure a per-layer profile of a model and write it as JSON.

The profile is the planner's only knowledge of the model (DAPPLE 4.1); this command
produces it the way PipeDream's profiler does (PipeDream 3.2): each layer is timed on one
device for one micro-batch: forward and backward time, output, parameter and stash sizes
(lightning_dapple/profile/profiler.py says what is measured).

--model names a callable (module:attr) returning an nn.Module or a LightningModule, or a
class instantiated with no arguments. A model without a layer sequence (or --layers auto)
gets the layer list traced from its forward (profile/traced_layers.py), printed before
the profile. The sample micro-batch is the module's example_input_array (the Lightning
convention); --batch-size resizes its leading dimension. Bad input prints one
"error: ..." line and exits with status 2.

Examples:
  dapple-profile --model my_pkg.models:make_model --out profile.json
  dapple-profile --model my_pkg.models:make_model --layers encoder.blocks --batch-size 8 --device cuda --out profile.json
  dapple-profile --model my_pkg.models:Net --layers auto --repeats 10 --cache-dir .profiles --out profile.json
  dapple-plan --profile profile.json --cluster 1x4 --global-batch-size 64    # then plan with it
"""
from __future__ import annotations

import argparse
import sys

from lightning_dapple.cli.common import ArgumentError, parser_from_doc

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = parser_from_doc("dapple-profile", __doc__)
    parser.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY", help="import path of a callable or class returning the model")
    parser.add_argument(
        "--layers",
        default="layers",
        help="attribute holding the layer sequence; dotted paths allowed; 'auto' traces the layer list from forward, "
        "as happens for a model without the default (default: layers)",
    )
    parser.add_argument("--batch-size", type=int, default=None, metavar="N", help="resize example_input_array's leading dimension to N samples")
    parser.add_argument("--device", default="cpu", help="device to time each layer on, e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--repeats", type=int, default=5, metavar="N", help="timed runs per layer; the median is kept (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed runs per layer first (default: 2)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR", help="reuse a stored profile of the same layers, input and device from this folder")
    parser.add_argument("--name", default=None, help="profile name (default: the factory name)")
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the profile JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from lightning_dapple.cli.profile_run import run  # torch: only once there is a model to time

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
