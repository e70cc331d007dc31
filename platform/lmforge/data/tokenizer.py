"""Tokenizers from the `tokenizers` library: load a tokenizer.json or train a byte-level BPE.

The end-of-document token separates packed documents; its id is recorded in the
dataset manifest so the trainer and any later tool agree on it. A tokenizer.json
from a Hugging Face model names its own in the `tokenizer_config.json` beside it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.errors import UserError
from lmforge.jsonfile import read_object

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_CONFIG = "tokenizer_config.json"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data.tokenizer: {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise UserError(f"data.tokenizer: {path} is not a tokenizer.json ({err})") from None


def beyond_the_model(tokenizer: Tokenizer, vocab_size: int) -> str | None:
    """Why this tokenizer would turn text into ids the model has no embedding rows
    for, or None. Special tokens added past the rows are let be, as transformers lets
    them be: a released tokenizer may name a placeholder (another modality's, say) that
    its text model has no row for and text does not hold."""
    base = tokenizer.get_vocab_size(with_added_tokens=False)
    if base > vocab_size:
        return f"has {base} tokens, more than the model's vocabulary of {vocab_size}"
    past = sorted(i for i, token in tokenizer.get_added_tokens_decoder().items() if i >= vocab_size and not token.special)
    if past:
        return f"adds tokens of ids {', '.join(map(str, past[:3]))}{', ...' if len(past) > 3 else ''}, past the model's vocabulary of {vocab_size}"
    return None


def end_of_text_token(tokenizer_file: str | Path | None) -> str:
    """The `eos_token` of the tokenizer_config.json beside a tokenizer.json, else lmforge's."""
    if tokenizer_file is None:
        return EOS_TOKEN
    sidecar = Path(tokenizer_file).with_name(TOKENIZER_CONFIG)
    try:
        token = read_object(sidecar).get("eos_token") if sidecar.is_file() else None
    except ValueError as err:
        raise UserError(str(err)) from None
    if isinstance(token, dict):  # an AddedToken as transformers saves it
        token = token.get("content")
    return token or EOS_TOKEN


def eos_id(tokenizer: Tokenizer, token: str = EOS_TOKEN) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise UserError(f"data.tokenizer: has no {token} token to separate documents")
    return token_id


def tokenizer_files(tokenizer_json: str, eos_token: str, max_length: int) -> dict[str, str]:
    """tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer
    loads with no custom code (the end-of-text token as eos and bos, as in packing)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "bos_token": eos_token,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer.json": tokenizer_json, TOKENIZER_CONFIG: json.dumps(config, indent=2) + "\n"}


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
