"""The run summary table the app's sweep and results print."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from rich.table import Table

__all__ = ["summary_table"]


def summary_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str]], title: str) -> Any:
    """A rich table of ``rows`` (dicts) with ``columns`` as (key, header) pairs."""
    table = Table(title=title)
    for _, header in columns:
        table.add_column(header)
    for row in rows:
        table.add_row(*("-" if row.get(key) is None else str(row.get(key)) for key, _ in columns))
    return table

