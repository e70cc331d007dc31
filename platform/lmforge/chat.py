"""Chats as a model reads them: which Jinja template (a user's file, else the model
directory's tokenizer_config.json, else lmforge's default) and rendering messages
with it in a sandbox. Serving, instruction distillation and the judge share it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmforge.errors import UserError
from lmforge.jsonfile import read_object

# When neither a template file nor the model's tokenizer_config.json gives one: each
# message as a role line then its content, and the assistant's line last.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant")


def is_message(message) -> bool:
    return isinstance(message, dict) and set(message) == {"role", "content"} and message["role"] in ROLES and isinstance(message["content"], str)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template (None: lmforge's default) and the special tokens it may
    write (`bos_token`, `eos_token`, from the model's tokenizer_config.json, as
    transformers passes them). A rendered chat holds its special tokens already:
    encode it without the tokenizer's own (`add_special_tokens=False`), as
    transformers' `apply_chat_template` does."""

    text: Optional[str] = None
    bos_token: str = ""
    eos_token: str = ""
    origin: str = "lmforge's default template"  # the file (and field) it came from, for messages


def chat_template_of(model_dir: Optional[str | Path], template_file: Optional[str] = None, name: str = "chat_template") -> ChatTemplate:
    """The template chats are rendered with: `template_file` (`name` is the setting that
    gave it), else the model directory's tokenizer_config.json `chat_template`, else
    lmforge's default; with the directory's bos and eos tokens either way."""
    config_file = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    try:
        config = read_object(config_file) if config_file is not None and config_file.is_file() else {}
    except ValueError as err:
        raise UserError(str(err)) from None
    tokens = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise UserError(f"{name}: {path} does not exist")
        return ChatTemplate(path.read_text(), **tokens, origin=str(path))
    template = config.get("chat_template")
    if isinstance(template, str):
        return ChatTemplate(template, **tokens, origin=f"{config_file} (chat_template)")
    return ChatTemplate(None, **tokens)


def _token_text(token) -> str:
    """A special token as tokenizer_config.json holds it: a string, or transformers'
    AddedToken as {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def chat_renderer(template: ChatTemplate, name: str = "chat_template"):
    """A chat as the model reads it, by a Jinja template in a sandbox (a template is
    code from a model directory or a user's file: it gets no Python objects); `name`:
    where the template came from, for messages."""
    environment = ImmutableSandboxedEnvironment(keep_trailing_newline=True, extensions=["jinja2.ext.loopcontrols"])
    environment.globals["raise_exception"] = _raise_exception  # what transformers gives templates, for their own refusals
    try:
        compiled = environment.from_string(template.text or DEFAULT_CHAT_TEMPLATE)
    except TemplateError as err:
        raise UserError(f"{name}: {template.origin} is not a Jinja template ({err})") from None

    def render(messages: list[dict]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, bos_token=template.bos_token, eos_token=template.eos_token)
        except Exception as err:  # noqa: BLE001 - a template is code: it can fail in any of Python's ways
            raise UserError(f"{name}: {template.origin} failed to render a chat ({err})") from None

    return render


def _raise_exception(message: str):
    raise TemplateError(message)
