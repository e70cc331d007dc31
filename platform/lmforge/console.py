"""The one way lmforge makes rich consoles and progress columns: every string is
printed as plain text. Messages carry outside text (gloo's errors hold paths in
square brackets, job names, user paths) that rich's markup parser would crash on."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import TextColumn
from rich.text import Text


def text_console(stderr: bool = True) -> Console:
    """A console that never reads markup, emoji codes or highlighting into what it prints."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False)


def plain(value: Any) -> Text:
    """`value` as literal text, whatever console (a caller's, with markup on) prints it."""
    return Text(str(value))


def text_column(template: str, bold: bool = False) -> TextColumn:
    """A progress column whose filled-in template (task descriptions name paths and teachers) is text."""
    return TextColumn(template, style="bold" if bold else "none", markup=False)
