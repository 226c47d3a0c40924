"""What the command-line tools share: one wording for the options they have in common, the
ooo and schedule vocabulary of DappleStrategy, and help text made from the module
docstring (description above "Examples:", the examples as the epilog).

Light on purpose: --help of every tool answers without torch or Lightning.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy.ooo_choice import decide_ooo, with_ooo_choice

__all__ = [
    "CLUSTER_HELP",
    "OOO_CHOICES",
    "ArgumentError",
    "OneLineParser",
    "add_ooo",
    "ooo_finisher",
    "ooo_setting",
    "parser_from_doc",
]

CLUSTER_HELP = "the hardware to plan for: a preset (paper-a, paper-b, paper-c), MACHINESxDEVICES (e.g. 2x8), or a cluster JSON/YAML file"
OOO_CHOICES = ("auto", "true", "false")


class ArgumentError(Exception):
    """A command line argparse refuses; reported as one line like every other bad input."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        raise ArgumentError(message)


def parser_from_doc(prog: str, doc: str) -> OneLineParser:
    """A parser whose description is ``doc`` up to its "Examples:" paragraph and whose
    epilog is that paragraph, both printed as written."""
    body, marker, examples = doc.partition("\nExamples:\n")
    head, _, rest = body.strip().partition("\n\n")
    description = head.split(": ", 1)[-1] if head.startswith(prog) else head
    if rest.strip():
        description = f"{description}\n\n{rest.strip()}"
    return OneLineParser(
        prog=prog,
        description=description,
        epilog=f"Examples:\n{examples.rstrip()}" if marker else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_ooo(parser: argparse.ArgumentParser, default_text: str) -> None:
    """``--ooo auto|true|false`` as ``DappleStrategy(ooo=...)`` takes it; ``--ooo`` alone is true."""
    parser.add_argument(
        "--ooo",
        nargs="?",
        const="true",
        default=None,
        choices=OOO_CHOICES,
        metavar="{auto,true,false}",
        help="out-of-order backprop (weight gradients deferred into the bubbles), as DappleStrategy(ooo=...): true, false, "
        f"or auto (on where the simulator says it makes this plan's step faster); --ooo alone means true; {default_text}",
    )


def ooo_setting(value: str | None) -> bool | str | None:
    """``--ooo``'s text as ``DappleStrategy(ooo=...)`` takes it (None: not given)."""
    if value is None:
        return None
    if value not in OOO_CHOICES:
        raise DappleConfigError("--ooo", f"is {value!r}", "use auto, true or false")
    return value if value == "auto" else value == "true"


def ooo_finisher(setting: bool | str | None, profile: Any, cluster: Any) -> Callable[[Any], Any] | None:
    """What a run does to a planned plan with ``ooo=setting`` (``strategy.ooo_choice``):
    applied to every candidate the schedule choice prices, so each is compared as it would
    run; None when the setting is not given."""
    if setting is None:
        return None

    def finish(plan: Any) -> Any:
        on, why = decide_ooo(setting, plan, profile, cluster)
        return with_ooo_choice(plan, on, why)

    return finish
