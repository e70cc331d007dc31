"""Chats and prompts tokenized as transformers does it, for tokenizers shaped like the
released ones: Llama 3's (a BOS added by the tokenizer, a template writing
`bos_token`, `eos_token` after each assistant turn) and Qwen's ChatML (no BOS). The
ids equal `AutoTokenizer`'s, for plain text and for `apply_chat_template`."""

import json
import shutil

import pytest
from tokenizers import AddedToken, processors

from lmforge.chat import chat_renderer, chat_template_of
from lmforge.data.tokenizer import load_tokenizer
from lmforge.errors import UserError

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = {
    # specials, (bos, eos), the BOS the tokenizer adds itself, template
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
        ("<|begin_of_text|>", "<|end_of_text|>"),
        True,
        LLAMA3,
    ),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], (None, "<|im_end|>"), False, CHATML),
}
CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What does def mean?"},
    {"role": "assistant", "content": "It defines a function."},
    {"role": "user", "content": "And return?  ünïcode"},
]


@pytest.fixture(params=list(FAMILIES))
def model_dir(request, hf_tokenizer, tmp_path):
    specials, (bos, eos), adds_bos, template = FAMILIES[request.param]
    tokenizer = load_tokenizer(hf_tokenizer / "tokenizer.json")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if adds_bos:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    # eos as an AddedToken, the way transformers saves one; bos as a plain string.
    added = {"__type": "AddedToken", "content": eos, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": added, "chat_template": template}
    if bos:
        config["bos_token"] = bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_plain_text_and_chats_get_transformers_ids(model_dir):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(model_dir)
    ours = load_tokenizer(model_dir / "tokenizer.json")
    text = "def generate(prompt):\n    return [token for token in prompt]  # ünïcode"
    assert ours.encode(text).ids == theirs(text)["input_ids"]
    rendered = chat_renderer(chat_template_of(model_dir))(CHAT)
    expected = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ours.encode(rendered, add_special_tokens=False).ids == list(expected)
    assert rendered == theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_a_template_file_keeps_the_models_special_tokens(model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{{ bos_token }}[{{ messages[-1]['content'] }}]{{ eos_token }}")
    chosen = chat_template_of(model_dir, str(template))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert chat_renderer(chosen)(CHAT[-1:]) == f"{config.get('bos_token', '')}[{CHAT[-1]['content']}]{config['eos_token']['content']}"
    shutil.rmtree(template.parent)


# Mistral's way: a template that refuses chats whose roles do not alternate, through
# the `raise_exception` transformers gives templates, and leaves its loop with `break`.
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% if loop.index0 == 2 %}{% break %}{% endif %}{% endfor %}"
)


def test_a_template_renders_and_refuses_as_transformers_does(hf_tokenizer, tmp_path):
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    shutil.copy(hf_tokenizer / "tokenizer.json", tmp_path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": ALTERNATING}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    render, theirs = chat_renderer(chat_template_of(tmp_path)), AutoTokenizer.from_pretrained(tmp_path)
    alternating = [{"role": role, "content": f"turn {i}"} for i, role in enumerate(["user", "assistant"] * 2)]
    assert render(alternating) == theirs.apply_chat_template(alternating, tokenize=False, add_generation_prompt=True)
    with pytest.raises(TemplateError, match="must alternate"):
        theirs.apply_chat_template(CHAT, tokenize=False)
    with pytest.raises(UserError) as refused:
        render(CHAT)
    assert str(refused.value) == (
        f"chat_template: {tmp_path / 'tokenizer_config.json'} (chat_template) failed to render a chat "
        "(Conversation roles must alternate user/assistant/user/assistant/...)"
    )
