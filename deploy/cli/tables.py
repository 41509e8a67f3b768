"""The CLI's tables: rich tables, fitted to a terminal, printed whole (never wrapped) into a pipe or a file."""

from __future__ import annotations

from collections.abc import Iterable

from rich import box
from rich.console import Console
from rich.table import Table

WIDE = 10_000  # a pipe's or a file's width: rows stay whole for grep and scripts (use --json to parse)


def table(*columns: str, title: str | None = None, right: Iterable[str] = ()) -> Table:
    """A table with these column headers (those in `right` right-aligned, for numbers)."""
    out = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False, pad_edge=False)
    right = set(right)
    for name in columns:
        out.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    return out


def show(t: Table) -> None:
    """Print `t` on stdout: fitted to the terminal's width, or whole when stdout is not a terminal."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=WIDE)
    console.print(t)
