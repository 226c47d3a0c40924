"""The schedule table and its builders: one row per schedule, looked up by name; and
``validate_schedule`` on schedules written as text."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_dapple
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.schedule_table import SCHEDULE_TABLE, chunked_schedule_names, schedule_names, schedule_spec
from lightning_dapple.schedule import build_interleaved_schedule, build_schedule, build_zbv_schedule
from lightning_dapple.schedule.actions import format_actions
from lightning_dapple.schedule.registry import build_named, builder_for

PACKAGE = Path(lightning_dapple.__file__).parent


@pytest.mark.parametrize("name", list(SCHEDULE_TABLE))
def test_every_row_names_a_builder_in_the_schedule_layer(name: str) -> None:
    builder = builder_for(name)
    assert callable(builder)
    assert builder.__module__.startswith("lightning_dapple.schedule."), builder.__module__


def test_unknown_name_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(DappleConfigError, match="'1f1b', which is not a schedule. Fix: use one of"):
        schedule_spec("1f1b")


def test_table_answers_the_shape_questions() -> None:
    assert schedule_names() == ("dapple", "gpipe", "interleaved", "zbv")
    assert chunked_schedule_names() == ("interleaved", "zbv")
    assert schedule_spec("zbv").fixed_chunks == 2 and schedule_spec("zbv").splits_backward
    assert schedule_spec("gpipe").holds_every_micro_batch and not schedule_spec("dapple").holds_every_micro_batch


def test_built_by_name_equals_each_builder_called_directly() -> None:
    assert build_named("dapple", num_groups=3, micro_batches=5, warmups=[3, 2, 1]) == build_schedule("dapple", 3, 5, [3, 2, 1])
    assert build_named("gpipe", num_groups=2, micro_batches=4, warmups=None) == build_schedule("gpipe", 2, 4)
    assert build_named("zbv", num_groups=2, chunks=2, micro_batches=4, warmups=None) == build_zbv_schedule(2, 4)
    modes = ("always", "never", "never", "except_last")
    assert build_named("interleaved", num_groups=2, chunks=2, micro_batches=4, warmups=None, recompute=modes) == build_interleaved_schedule(
        2, 2, 4, recompute=modes
    )
    assert build_named("dapple", num_groups=2, micro_batches=2, warmups=None, recompute=("always", "never")).recompute == ("always", "never")


def _about_schedules(operand: ast.AST) -> bool:
    """Whether an operand holds a schedule name (``schedule``, ``plan.schedule``, a builder's
    ``name``), not the strategy's or the planner's, which are also called "dapple"."""
    if isinstance(operand, ast.Name):
        return "schedule" in operand.id or operand.id == "name"
    return isinstance(operand, ast.Attribute) and "schedule" in operand.attr


def _compared_names(tree: ast.AST) -> list[str]:
    """Schedule names compared with == / != / in (a tuple of literals) in one module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_about_schedules(o) for o in [node.left, *node.comparators]):
            for operand in [node.left, *node.comparators]:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                found += [v.value for v in values if isinstance(v, ast.Constant) and v.value in SCHEDULE_TABLE]
    return found


def test_no_module_dispatches_on_a_schedule_name_outside_the_table() -> None:
    """A new schedule is one row in the table and one builder: no module compares names."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = _compared_names(ast.parse(path.read_text()))
        if names:
            offenders[str(path.relative_to(PACKAGE))] = names
    assert offenders == {}


def test_validate_schedule_takes_what_the_builders_print() -> None:
    straight = build_schedule("dapple", 3, 4)
    assert lightning_dapple.validate_schedule(format_actions(straight.actions)).actions == straight.actions
    vee = build_zbv_schedule(2, 4)
    checked = lightning_dapple.validate_schedule(format_actions(vee.orders), placement=vee.placement)
    assert checked.actions == vee.actions and checked.orders == vee.orders


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0 0SEND_F0 0RECV_B0 0B0\n1RECV_F0 1F0 1SEND_B0", "stage 1: lacks the backward of micro-batch 0. Fix: add 1B0"),
        ("0F0 0RECV_B0 0B0\n1RECV_F0 1F0 1B0 1SEND_B0", "stage 0: lacks the send of its output for micro-batch 0. Fix: add 0SEND_F0"),
        ("0RECV_B0 0F0 0SEND_F0 0B0\n1RECV_F0 1F0 1B0 1SEND_B0", "cannot complete: .*stuck at 0RECV_B0"),
        ("0F0 0Q0", "cannot parse action '0Q0'"),
        ("0F0 0B0\n\n2F0 2B0", "has 2 lines but names stages up to 2"),
    ],
)
def test_validate_schedule_names_the_problem_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(DappleConfigError, match=message) as caught:
        lightning_dapple.validate_schedule(text)
    assert str(caught.value).count("Fix:") == 1

