"""The judge's protocol pieces: verdict parsing (the last [[X]], a bare letter, nothing),
the two-order outcome table, and its bad input (prompt files, endpoints)."""

import pytest

from lmforge.errors import UserError
from lmforge.evaluation.judge import Endpoint, aggregate, outcome, parse_verdict, read_prompts


@pytest.mark.parametrize(
    "text, verdict",
    [
        ("Assistant A is better. [[A]]", "A"),
        ("[[A]] at first, but on reflection [[B]]", "B"),
        ("tie: [[C]]", "C"),
        ("[[ B ]]", "B"),
        ("A", "A"),
        (" b. ", "B"),
        ("Tie", "C"),
        ("I cannot decide.", None),
        ("", None),
        (None, None),
        ("[[D]]", None),
    ],
)
def test_verdicts_parse(text, verdict):
    assert parse_verdict(text) == verdict


@pytest.mark.parametrize(
    "first, swapped, result",
    [
        ("A", "B", "win"),
        ("B", "A", "loss"),
        ("C", "C", "tie"),
        ("A", "A", "inconsistent"),
        ("B", "B", "inconsistent"),
        ("A", "C", "inconsistent"),
        ("C", "B", "inconsistent"),
        (None, "A", "unparsable"),
        ("A", None, "unparsable"),
    ],
)
def test_a_pair_is_decided_only_when_both_orders_agree(first, swapped, result):
    assert outcome(first, swapped) == result


def test_aggregate_rates_sum_to_one():
    rows = [
        {"outcome": o, "verdicts": v}
        for o, v in [
            ("win", {"a_first": "A", "b_first": "B"}),
            ("unparsable", {"a_first": None, "b_first": None}),
            ("error", {}),
            ("win", {"a_first": "A", "b_first": "B"}),
        ]
    ]
    report = aggregate(rows)
    assert report["counts"] == {"win": 2, "loss": 0, "tie": 0, "inconsistent": 0, "unparsable": 1, "error": 1}
    assert report["rates"]["win"] == 0.5 and sum(report["rates"].values()) == 1.0 and report["unparsable"] == 2


def test_bad_prompt_files_and_endpoints(tmp_path):
    bad = tmp_path / "p.jsonl"
    for text, fragment in [
        ('{"prompt": "x"}\nnot json\n', "p.jsonl:2: not JSON"),
        ('{"text": "x"}\n', "p.jsonl:1: expected"),
        ('{"messages": [{"role": "system", "content": "s"}]}\n', "without a user message"),
        ("\n", "holds no prompts"),
    ]:
        bad.write_text(text)
        with pytest.raises(UserError, match=fragment):
            read_prompts(str(bad))
    with pytest.raises(UserError, match="--prompts: .* does not exist"):
        read_prompts(str(tmp_path / "absent.jsonl"))
    with pytest.raises(UserError, match="--judge: 'localhost:8000' is not an OpenAI-compatible base URL"):
        Endpoint.parse("--judge", "localhost:8000", local_allowed=False)
    assert Endpoint.parse("--b", "http://h:1/v1/#m", local_allowed=True) == Endpoint("--b", "http://h:1/v1", "m")
