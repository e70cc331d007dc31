"""Structured output through the continuous engine (llguidance over a real BPE
tokenizer, a random tiny model that knows no JSON): every sequence, greedy or sampled,
ends with text its grammar accepts; a sequence beside them without one generates what
it would alone; a grammar that cannot be compiled is a 400 naming its field."""

import json
import re

import jsonschema
import pytest
from test_serve_engine import Listener

from lmforge.data.tokenizer import EOS_TOKEN, train_bpe
from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.models.build import build_model
from lmforge.models.config import PRESETS
from lmforge.serve.engine import ContinuousBatcher, Sequence
from lmforge.serve.protocol import APIError, CompletionRequest, parse
from lmforge.serve.structured import Grammars

VERDICT = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["A", "B", "tie"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        "reason": {"type": "string", "maxLength": 12},
    },
    "required": ["verdict", "confidence", "reason"],
    "additionalProperties": False,
}
# (the request's field, what the text must satisfy)
CONSTRAINTS = {
    "json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}},
        lambda t: jsonschema.validate(json.loads(t), VERDICT),
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    "regex": ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t) or pytest.fail(t)),
    "choice": ({"structured_outputs": {"choice": ["red", "green", "blue (dark)"]}}, lambda t: t in ("red", "green", "blue (dark)") or pytest.fail(t)),
    "lark": ({"structured_outputs": {"grammar": 'start: "yes" | "no" | "n/a"'}}, lambda t: t in ("yes", "no", "n/a") or pytest.fail(t)),
}
# What cannot be compiled, and the field named.
REFUSED = {
    "not a schema type": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format.json_schema.schema",
    ),
    "a schema that is not JSON": ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    "an unclosed regex": ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    "a Lark grammar without start": ({"structured_outputs": {"grammar": 'begin: "x"'}}, "structured_outputs.grammar"),
}


@pytest.fixture(scope="module")
def served():
    text = json.dumps([VERDICT, {"answer": "yes", "colour": "green", "id": "123-abc"}] * 20) + " red green blue no n/a 0123456789"
    tokenizer = train_bpe([text], 400)
    model = build_model(PRESETS["tiny"], seed=3).eval()
    eos = frozenset({tokenizer.token_to_id(EOS_TOKEN)})
    return model, tokenizer, Grammars(tokenizer, tokenizer.get_vocab_size(), eos), eos


def request(extra: dict) -> CompletionRequest:
    return parse(CompletionRequest, {"model": "m", "prompt": "x", **extra})


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_sequence_ends_in_text_its_grammar_accepts(served, name):
    model, tokenizer, grammars, eos = served
    extra, check = CONSTRAINTS[name]
    grammar = grammars.compile(request(extra))
    engine = ContinuousBatcher(model, eos, grammars.vocab, max_running=4)
    prompt = tokenizer.encode("Answer: ").ids
    params = [SamplingParams(max_new_tokens=96, temperature=0)] + [SamplingParams(max_new_tokens=96, temperature=1.0) for _ in range(5)]
    listeners = [Listener() for _ in params]
    free = Listener()
    free_params = SamplingParams(max_new_tokens=20, temperature=0.8, stop_at_eos=False)
    engine.submit(Sequence(prompt, free_params, free, seed=99))
    for seed, (listener, sampling) in enumerate(zip(listeners, params)):
        engine.submit(Sequence(prompt, sampling, listener, seed=seed, constraint=grammars.constraint(grammar)))
    for listener in (*listeners, free):
        assert listener.done.wait(60)
    texts = [tokenizer.decode(listener.tokens, skip_special_tokens=True) for listener in listeners]
    for listener, text, sampling in zip(listeners, texts, params):
        if name == "json_object" and listener.finish == "length":
            # Any object may go on for ever (a random model seldom closes one), as OpenAI's
            # `length`; the bounded grammars above must end.
            assert len(listener.tokens) == sampling.max_new_tokens and text.startswith("{"), text
            continue
        assert listener.finish == "stop", (name, text)
        check(text)
    assert len(set(texts)) > 1 or name == "choice", "sampled sequences should differ"
    assert free.tokens == generate_ids(model, [prompt], free_params, vocab=grammars.vocab, row_seeds=[99])[0].tokens


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_grammar_that_cannot_be_compiled_is_a_400_naming_its_field(served, name):
    extra, field = REFUSED[name]
    with pytest.raises(APIError) as refused:
        served[2].compile(request(extra))
    assert (refused.value.status, refused.value.param) == (400, field)
    assert refused.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_a_constraint_the_api_does_not_define_is_refused_at_the_door(extra, field):
    with pytest.raises(APIError) as refused:
        request(extra)
    assert (refused.value.status, refused.value.param) == (400, field)
