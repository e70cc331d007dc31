"""Prompts for instruction distillation: read from JSONL or Parquet (a local path or an
fsspec URI), a text column or chat messages rendered with a chat template, every one
checked before anything starts, and which of them are held out for evaluation.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow.parquet as pq

from lmforge.chat import ROLES, ChatTemplate, chat_renderer, is_message
from lmforge.data.packing import held_out
from lmforge.errors import UserError


@dataclass(frozen=True)
class Prompt:
    index: int  # in file order, from 0
    text: str  # as the teacher reads it (a chat rendered)
    held_out: bool
    chat: bool = False  # rendered from messages: its special tokens are in the text already


def read_prompts(instruct, template: ChatTemplate) -> list[Prompt]:
    """Every prompt of `distill.instruct.prompts`, in file order; `UserError` naming the
    file (and the line or row) for anything that is not a prompt."""
    rows = _rows(instruct.prompts)
    if not rows:
        raise UserError(f"distill.instruct.prompts: {instruct.prompts} holds no prompts")
    render = functools.cache(lambda: chat_renderer(template, "distill.instruct.chat_template"))  # compiled at the first chat, if any
    prompts = []
    for index, row in enumerate(rows):
        text, chat = _text(row, index, instruct, render)
        prompts.append(Prompt(index, text, held_out(index, instruct.eval_fraction), chat))
    return prompts


def _rows(uri: str) -> list[dict]:
    suffix = Path(uri.split("?")[0]).suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise UserError(f"distill.instruct.prompts: {uri} is neither JSON lines (.jsonl) nor Parquet (.parquet)")
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.isfile(path):
            raise UserError(f"distill.instruct.prompts: {uri} does not exist")
        if suffix == ".parquet":
            with fs.open(path, "rb") as f:
                return pq.read_table(f).to_pylist()
        with fs.open(path, "rt", encoding="utf-8") as f:
            return [_json_line(line, number, uri) for number, line in enumerate(f, 1) if line.strip()]
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - fsspec and pyarrow raise many kinds for unreadable files
        raise UserError(f"distill.instruct.prompts: cannot read {uri} ({err})") from None


def _json_line(line: str, number: int, uri: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError as err:
        raise UserError(f"distill.instruct.prompts: {uri} line {number} is not JSON ({err})") from None
    if not isinstance(row, dict):
        raise UserError(f"distill.instruct.prompts: {uri} line {number} is not a JSON object")
    return row


def _text(row: dict, index: int, instruct, render) -> tuple[str, bool]:
    """The prompt's text, and whether it is a chat rendered by the template."""
    where = f"{instruct.prompts} prompt {index + 1}"
    if instruct.prompt_column in row:
        text = row[instruct.prompt_column]
        if not isinstance(text, str) or not text:
            raise UserError(f"distill.instruct.prompt_column: {where}: {instruct.prompt_column!r} is not a non-empty string")
        return text, False
    if instruct.messages_column not in row:
        raise UserError(
            f"distill.instruct.prompts: {where} has neither a {instruct.prompt_column!r} nor a {instruct.messages_column!r} "
            f"column (it has {sorted(row)}); set distill.instruct.prompt_column or messages_column"
        )
    messages = row[instruct.messages_column]
    if not isinstance(messages, list) or not messages or not all(is_message(m) for m in messages):
        raise UserError(
            f"distill.instruct.messages_column: {where}: {instruct.messages_column!r} must be a non-empty list of "
            f"{{role, content}} pairs with role one of {', '.join(ROLES)}"
        )
    try:
        return render()(messages), True
    except UserError as err:
        raise UserError(f"{err} at {where}") from None
