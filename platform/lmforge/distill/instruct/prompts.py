"""Prompts for instruction distillation: read from JSONL or Parquet (a local path or an
fsspec URI), a text column or chat messages rendered with a chat template, every one
checked before anything starts, and which of them are held out for evaluation.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import fsspec
import pyarrow.parquet as pq

from lmforge.data.packing import held_out
from lmforge.errors import UserError
from lmforge.jsonfile import read_object

# When neither `distill.instruct.chat_template` nor the teacher's tokenizer_config.json
# gives one: each message as a role line then its content, and the assistant's line last.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    index: int  # in file order, from 0
    text: str  # as the teacher reads it (a chat rendered)
    held_out: bool


def read_prompts(instruct, template: Optional[str]) -> list[Prompt]:
    """Every prompt of `distill.instruct.prompts`, in file order; `UserError` naming the
    file (and the line or row) for anything that is not a prompt."""
    rows = _rows(instruct.prompts)
    if not rows:
        raise UserError(f"distill.instruct.prompts: {instruct.prompts} holds no prompts")
    render = functools.cache(lambda: chat_renderer(template))  # compiled at the first chat, if any
    prompts = []
    for index, row in enumerate(rows):
        text = _text(row, index, instruct, render)
        prompts.append(Prompt(index, text, held_out(index, instruct.eval_fraction)))
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


def _text(row: dict, index: int, instruct, render) -> str:
    where = f"{instruct.prompts} prompt {index + 1}"
    if instruct.prompt_column in row:
        text = row[instruct.prompt_column]
        if not isinstance(text, str) or not text:
            raise UserError(f"distill.instruct.prompt_column: {where}: {instruct.prompt_column!r} is not a non-empty string")
        return text
    if instruct.messages_column not in row:
        raise UserError(
            f"distill.instruct.prompts: {where} has neither a {instruct.prompt_column!r} nor a {instruct.messages_column!r} "
            f"column (it has {sorted(row)}); set distill.instruct.prompt_column or messages_column"
        )
    messages = row[instruct.messages_column]
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise UserError(
            f"distill.instruct.messages_column: {where}: {instruct.messages_column!r} must be a non-empty list of "
            f"{{role, content}} pairs with role one of {', '.join(ROLES)}"
        )
    return render()(messages)


def _is_message(message) -> bool:
    return isinstance(message, dict) and set(message) == {"role", "content"} and message["role"] in ROLES and isinstance(message["content"], str)


def chat_renderer(template: Optional[str], name: str = "distill.instruct.chat_template"):
    """A chat as the model reads it, by a Jinja template in a sandbox (a template is
    code from a model directory or a user's file: it gets no Python objects); `name`:
    where the template came from, for messages."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        compiled = ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(template or DEFAULT_CHAT_TEMPLATE)
    except TemplateError as err:
        raise UserError(f"{name}: not a Jinja template ({err})") from None

    def render(messages: list[dict]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        except TemplateError as err:
            raise UserError(f"{name}: rendering a chat failed ({err})") from None

    return render


def chat_template(instruct, teacher_dir: Optional[Path]) -> Optional[str]:
    """The template chats are rendered with: the job's file, else the teacher directory's
    tokenizer_config.json `chat_template`, else None (lmforge's default)."""
    if instruct.chat_template:
        path = Path(instruct.chat_template)
        if not path.is_file():
            raise UserError(f"distill.instruct.chat_template: {path} does not exist")
        return path.read_text()
    config = teacher_dir / "tokenizer_config.json" if teacher_dir is not None else None
    if config is None or not config.is_file():
        return None
    try:
        template = read_object(config).get("chat_template")
    except ValueError as err:
        raise UserError(str(err)) from None
    return template if isinstance(template, str) else None
