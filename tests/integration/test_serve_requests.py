"""One replica's HTTP app (the one `lmforge serve` runs on Ray Serve), served here by
uvicorn in this process over real HTTP, no Ray: every field out of its range is a
400 naming it; malformed, nested and oversized bodies are 4xx in OpenAI's shape with
no internals in the message; every route but /health wants the key (any case of
`Bearer`); a full queue answers 503 at once; and hundreds of generated bodies never
get a 5xx while a stream beside them finishes with what it generates alone."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.inference.generate import Generator
from lmforge.inference.sampling import SamplingParams
from lmforge.serve.api import build_api
from lmforge.serve.backend import Backend, ResponseCache
from lmforge.serve.options import ServerOptions, key_digest
from ports import free_port

KEY = "request-tests-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 << 10
INTERNALS = ("Traceback", "Error:", "Exception", 'File "', "site-packages")


class Server:
    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def url(self, route: str) -> str:
        return f"http://127.0.0.1:{self.port}{route}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.uvicorn.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.uvicorn.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def backend(tmp_path_factory, hf_tokenizer):
    from hf_models import make_hf_model

    model = tmp_path_factory.mktemp("served-model")
    make_hf_model(model, "untied-gqa", hf_tokenizer, seed=1)
    options = ServerOptions(model=str(model), name="m", max_running=2, max_waiting=4, max_body_bytes=BODY_LIMIT, api_key_sha256=key_digest(KEY))
    return Backend(options)


@pytest.fixture(scope="module")
def server(backend):
    with Server(build_api(backend)) as running:
        yield running


def post(server, body, route="/v1/completions", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps writes NaN as the token NaN
    return httpx.post(server.url(route), content=content, headers=AUTH | {"content-type": "application/json"}, timeout=60, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, param=None, fragment: str = "") -> None:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert fragment in error["message"] and not any(word in error["message"] for word in INTERNALS), error["message"]


OK = {"model": "m", "prompt": "def ", "max_tokens": 4}
OUT_OF_RANGE = {
    "a seed past 2**63": (OK | {"seed": 2**64}, "seed"),
    "a negative seed": (OK | {"seed": -1}, "seed"),
    "a vanishing repetition penalty": (OK | {"repetition_penalty": 1e-39}, "repetition_penalty"),
    "a huge repetition penalty": (OK | {"repetition_penalty": 1e39}, "repetition_penalty"),
    "a NaN temperature": (OK | {"temperature": float("nan")}, "temperature"),
    "an infinite top_p": (OK | {"top_p": float("inf")}, "top_p"),
    "a zero top_p": (OK | {"top_p": 0}, "top_p"),
    "a top_k past any vocabulary": (OK | {"top_k": 2**40}, "top_k"),
    "max_tokens past any context": (OK | {"max_tokens": 2**40}, "max_tokens"),
    "n past the door": (OK | {"n": 10**6}, "n"),
    "a stop of 300 characters": (OK | {"stop": ["x" * 300]}, "stop"),
    "five stops": (OK | {"stop": list("abcde")}, "stop"),
    "65 prompts": (OK | {"prompt": ["x"] * 65}, "prompt"),
    "a token id past the vocabulary": (OK | {"prompt": [5, 10**6]}, "prompt"),
    "a negative token id": (OK | {"prompt": [[3], [-1]]}, "prompt"),
    "no token ids": (OK | {"prompt": [[]]}, "prompt"),
    "ids and text mixed": (OK | {"prompt": ["x", 3]}, "prompt"),
    "echo past the context": (OK | {"prompt": [7] * 300, "echo": True, "max_tokens": 0}, "prompt"),
    "a prompt no context holds": (OK | {"prompt": "y" * 60_000}, "prompt"),
    "a model name of 10k characters": (OK | {"model": "m" * 10_000}, "model"),
}


@pytest.mark.parametrize("case", OUT_OF_RANGE)
def test_a_field_out_of_range_is_a_400_naming_it(server, case):
    body, param = OUT_OF_RANGE[case]
    assert_openai_error(post(server, body), 400, param, param)


MALFORMED = {
    "deeply nested": (b"[" * 30_000 + b"]" * 30_000, 400, "nested too deeply"),
    "a lone surrogate": (b'{"model": "m", "prompt": "\\ud800", "max_tokens": 2}', 400, "lone surrogate"),
    "not UTF-8": (b'{"model": "m", "prompt": "\xff\xfe"}', 400, "malformed JSON"),
    "not JSON": (b"{not json", 400, "malformed JSON"),
    "a list, not an object": (b"[1, 2]", 400, "must be a JSON object"),
    "a body over the limit": (json.dumps(OK | {"prompt": "z" * BODY_LIMIT}).encode(), 413, "at most 65536"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_or_oversized_body_is_a_4xx_without_internals(server, case):
    body, status, fragment = MALFORMED[case]
    assert_openai_error(post(server, body), status, None, fragment)


def test_a_body_without_a_declared_length_is_cut_at_the_limit(server):
    def chunks():
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024

    response = httpx.post(server.url("/v1/completions"), content=chunks(), headers=AUTH, timeout=60)
    assert_openai_error(response, 413, None, "over 65536 bytes")


def test_every_route_but_health_wants_the_key_in_any_case_of_its_scheme(server):
    for route in ("/v1/models", "/metrics"):
        assert_openai_error(httpx.get(server.url(route)), 401, None, "API key")
        assert_openai_error(httpx.get(server.url(route), headers={"Authorization": f"Basic {KEY}"}), 401, None, "API key")
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert httpx.get(server.url(route), headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200, (route, scheme)
    assert httpx.get(server.url("/health")).json() == {"status": "ok", "model": "m"}


def test_a_full_queue_answers_503_at_once_and_serves_the_rest(server):
    """2 running, 4 waiting: of 24 requests at once, those beyond are refused, not queued."""
    slow = OK | {"max_tokens": 100, "ignore_eos": True, "temperature": 0.5}
    with ThreadPoolExecutor(24) as pool:
        statuses = list(pool.map(lambda _: post(server, slow).status_code, range(24)))
    assert set(statuses) == {200, 503} and statuses.count(200) >= 6, statuses
    assert post(server, OK).status_code == 200


def test_the_response_cache_is_bounded_in_bytes():
    cache = ResponseCache(size=100, max_bytes=1000)
    for i in range(10):
        cache.put(f"k{i}", ["x" * 200])
    assert cache.bytes <= 1000 and len(cache.entries) == 4 and cache.get("k9") == ["x" * 200] and cache.get("k0") is None
    cache.put("huge", ["y" * 5000])  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.get("huge") is None and len(cache.entries) == 4


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.text(max_size=8), max_size=6),
    st.lists(st.integers(min_value=-3, max_value=2**20), max_size=6),  # token ids, some outside any vocabulary
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
FIELDS = [
    "messages",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "n",
    "stop",
    "seed",
    "stream",
    "logprobs",
    "echo",
    "ignore_eos",
    "max_completion_tokens",
    "top_logprobs",
    "stream_options",
]
ANY_BODY = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "other"]), "max_tokens": st.integers(min_value=-2, max_value=6)},
    optional={field: VALUES for field in FIELDS} | {"prompt": st.one_of(st.text(min_size=1, max_size=30), VALUES)},
)
SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "repetition_penalty": st.floats(0.01, 100),
    "stream": st.booleans(),
}
TEXT = st.text(min_size=1, max_size=30)
IN_RANGE = st.one_of(  # bodies every field of which is in range: most are answered
    st.fixed_dictionaries({"model": st.just("m"), "prompt": TEXT, "max_tokens": st.integers(1, 6)}, optional=SAMPLING),
    st.fixed_dictionaries(  # lm-evaluation-harness's shape: token ids, echo, the prompt's logprobs
        {"model": st.just("m"), "prompt": st.lists(st.integers(0, 255), min_size=1, max_size=12), "max_tokens": st.integers(0, 3)},
        optional=SAMPLING | {"echo": st.booleans(), "logprobs": st.integers(0, 5)},
    ),
    st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}), min_size=1, max_size=2),
            "max_tokens": st.integers(1, 6),
        },
        optional=SAMPLING,
    ),
)
BODIES = st.one_of(ANY_BODY, IN_RANGE)


def test_generated_bodies_get_200_or_4xx_while_a_stream_beside_them_is_untouched(server, backend):
    """Hundreds of bodies, each on /v1/completions and /v1/chat/completions, as a
    greedy stream runs beside them on the same replica (their sequences share its
    decode steps): never a 5xx, and the stream's text is what it generates alone."""
    streamed = OK | {"prompt": "import os\n", "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
    reference = Generator.load(backend.options.model)  # the served model in this process
    alone = reference.generate(["import os\n"], SamplingParams(max_new_tokens=60, temperature=0, stop_at_eos=False))[0].text
    text, finished = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.url("/v1/completions"), json=streamed, headers=AUTH, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        finished.set()

    beside = threading.Thread(target=stream)
    beside.start()
    seen: set[int] = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=BODIES, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def answered(body, route):
        response = post(server, body, route)
        seen.add(response.status_code)
        assert response.status_code < 500 or response.status_code == 503, (body, response.text)
        if response.status_code >= 400:
            assert_openai_error(response, response.status_code, response.json()["error"]["param"])

    answered()
    beside.join(120)
    assert finished.is_set() and "".join(text) == alone
    assert 200 in seen and 400 in seen
