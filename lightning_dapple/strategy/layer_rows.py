"""Layer outputs whose rows are not along the first dimension, and the cuts they cannot cross.

Split-concat (DAPPLE 5.2.2) regroups a boundary's rows where the stages on its two sides
have different replica counts: each receiver takes its rows from the senders that hold
them, cutting and concatenating along the first dimension (``profile/sample_rows.py``). A
value that holds the batch elsewhere, such as ``nn.LSTM``'s ``h_n`` of shape
(num_layers, rows, hidden), would be cut or taken whole along the wrong dimension. Where
both sides have the same replica count each receiver gets its one sender's tensors
untouched, so such a value is fine there.

The layers are run on two row counts; an output tensor that is neither per-sample at both
(first dimension = rows, the rest alike) nor one whole value (the same shape at both) holds
its rows elsewhere.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import Plan

__all__ = ["rows_elsewhere", "check_regrouped_cuts"]


def _per_sample(shapes: Sequence[torch.Size], rows: Sequence[int]) -> bool:
    return all(len(shape) > 0 and shape[0] == count for shape, count in zip(shapes, rows)) and len({shape[1:] for shape in shapes}) == 1


def rows_elsewhere(outputs: Sequence[Sequence[Any]], rows: Sequence[int]) -> dict[int, str]:
    """Layer index -> the shapes of an output tensor that holds its rows elsewhere than the
    first dimension, from each layer's outputs (``outputs[k][layer]``) at ``rows[k]`` rows."""
    found: dict[int, str] = {}
    for layer, values in enumerate(zip(*outputs)):
        leaves = [[leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)] for value in values]
        if len({len(each) for each in leaves}) != 1:
            continue
        for tensors in zip(*leaves):
            shapes = [tensor.shape for tensor in tensors]
            if not _per_sample(shapes, rows) and len(set(shapes)) > 1:
                found[layer] = ", ".join(f"{tuple(shape)} at {count} row{'s' if count > 1 else ''}" for shape, count in zip(shapes, rows))
                break
    return found


def check_regrouped_cuts(plan: Plan, elsewhere: dict[int, str]) -> None:
    """Refuse a plan cutting after such a layer where the replica count changes."""
    for before, after in zip(plan.stages, plan.stages[1:]):
        layer = before.end - 1
        if layer in elsewhere and before.replicas != after.replicas:
            raise DappleConfigError(
                "plan",
                f"cuts after layer {layer}, whose output holds the batch elsewhere than in its first dimension "
                f"(a tensor of shape {elsewhere[layer]}, such as an LSTM's h_n), between {before.replicas} and {after.replicas} "
                "replicas, where the rows are regrouped along the first dimension",
                "return batch-first tensors from that layer (h_n.transpose(0, 1)), give both sides of the cut the same number "
                "of replicas, or cut elsewhere",
            )
