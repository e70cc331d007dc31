"""Instruction distillation's parts without Ray: reading and rendering prompts, the
selection rules, answers laid out as SFT samples, and answers that depend on their
own seed only."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lmforge.chat import ChatTemplate
from lmforge.data.packing import ShardWriter
from lmforge.distill.config import InstructSpec, SelectSpec
from lmforge.distill_jobs.instruct.answers import ANSWER_SCHEMA
from lmforge.distill_jobs.instruct.prompts import read_prompts
from lmforge.distill_jobs.instruct.samples import write_samples
from lmforge.distill_jobs.instruct.selection import select
from lmforge.errors import UserError


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_prompts_are_read_in_order_chats_rendered_and_a_share_held_out(tmp_path):
    rows = [{"prompt": f"p{i}"} for i in range(6)] + [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}]
    prompts = read_prompts(InstructSpec(prompts=write_jsonl(tmp_path / "p.jsonl", rows), eval_fraction=0.25), ChatTemplate())
    assert [p.text for p in prompts[:6]] == [f"p{i}" for i in range(6)]
    assert [p.chat for p in prompts] == [False] * 6 + [True]  # a rendered chat is tokenized without added special tokens
    assert prompts[6].text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert [p.index for p in prompts if p.held_out] == [3]
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}=>"
    assert read_prompts(InstructSpec(prompts=str(tmp_path / "p.jsonl")), ChatTemplate(template))[6].text == "[system] be brief [user] hi =>"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "p.parquet")
    assert [p.text for p in read_prompts(InstructSpec(prompts=str(tmp_path / "p.parquet")), ChatTemplate())] == ["a", "b"]
    assert [p.text for p in read_prompts(InstructSpec(prompts=f"file://{tmp_path}/p.parquet"), ChatTemplate())] == ["a", "b"]  # an fsspec URI


def test_a_chat_template_gets_no_python_objects(tmp_path):
    """Templates come from model directories and users' files: rendered in Jinja's sandbox."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(UserError, match="distill.instruct.chat_template"):
        read_prompts(InstructSpec(prompts=path), ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}"))


@pytest.mark.parametrize(
    "rows, fragment",
    [
        (None, "does not exist"),
        ([], "holds no prompts"),
        ([{"text": "x"}], "has neither a 'prompt' nor a 'messages' column"),
        (["not json"], "line 1 is not JSON"),
        ([{"messages": [{"role": "user"}]}], "list of {role, content} pairs"),
        ([{"messages": "hi"}], "list of {role, content} pairs"),
        ([{"prompt": ""}], "not a non-empty string"),
    ],
)
def test_bad_prompts_files_are_refused_naming_the_field(tmp_path, rows, fragment):
    path = str(tmp_path / "p.jsonl") if rows is None else write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(UserError, match="distill.instruct") as err:
        read_prompts(InstructSpec(prompts=path), ChatTemplate())
    assert fragment in str(err.value)


def answers(*rows) -> pa.Table:
    """(prompt index, teacher, sample, prompt ids, answer ids, logprobs, finish) per answer."""
    columns = {name: [] for name in ANSWER_SCHEMA.names}
    for prompt_index, teacher, sample, prompt, reply, logprobs, finish in rows:
        values = dict(
            prompt_index=prompt_index,
            teacher=teacher,
            sample=sample,
            held_out=False,
            prompt_ids=prompt,
            answer_ids=reply,
            logprobs=logprobs,
            finish_reason=finish,
            topk_ids=[t * 10 + j for t in reply for j in range(2)],
            topk_logprobs=np.full(2 * len(reply), -0.5, dtype=np.float16),
        )
        for name, value in values.items():
            columns[name].append(value)
    return pa.table(columns, schema=ANSWER_SCHEMA)


def test_each_answer_is_dropped_by_the_first_rule_it_fails():
    table = answers(
        (0, 0, 0, [1, 2], [5, 6, 7], [-0.5, -0.5, -0.5], "length"),  # truncated
        (0, 0, 1, [1, 2], [5], [-0.1], "stop"),  # too short
        (0, 1, 0, [1, 2], [5, 6, 7, 8, 9], [-0.1] * 5, "stop"),  # too long
        (0, 1, 1, [1, 2], [5, 6], [-4.0, -4.0], "stop"),  # low log-probability
        (1, 0, 0, [3], [5, 6], [-1.0, -1.0], "stop"),  # kept: teacher 1's (1, 0) is worse
        (1, 1, 0, [3], [5, 7], [-2.0, -2.0], "stop"),  # not the best of its (prompt, sample)
        (2, 0, 0, [3], [5, 6], [-0.5, -0.5], "stop"),  # the same prompt text and answer as row 4: a duplicate
        (2, 1, 0, [3], [6, 6], [-2.5, -2.5], "stop"),  # kept: the only one of (2, 0) left
    )
    rules = SelectSpec(min_tokens=2, max_tokens=4, min_mean_logprob=-3.0)
    kept, dropped = select(table, rules, teachers=2)
    assert kept == [4, 7]
    assert dropped == {"truncated": 1, "too_short": 1, "too_long": 1, "low_logprob": 1, "duplicate": 1, "not_best": 1}
    assert select(table, rules.model_copy(update={"teachers": "all"}), teachers=2)[0] == [4, 5, 7]
    assert select(table, SelectSpec(drop_truncated=False, min_tokens=1, dedupe=False, teachers="all"), teachers=2)[0] == list(range(8))


def test_answers_become_samples_that_learn_the_answer_alone(tmp_path):
    table = answers((0, 0, 0, [1, 2, 3], [5, 6], [-1.0, -1.0], "stop"), (1, 1, 0, [4], [7, 8, 9], [-1.0] * 3, "length"))
    writer = ShardWriter(tmp_path, seq_len=7, shard_samples=8)
    assert write_samples(writer, table, [0, 1], seq_len=7, pad_id=0, k=2) == 5
    writer.close()
    got = pq.read_table(tmp_path / writer.shards[0]["file"]).to_pydict()
    assert got["tokens"] == [[1, 2, 3, 5, 6, 0, 0, 0], [4, 7, 8, 9, 0, 0, 0, 0]]
    # Target t is token t+1: the answer is learnt from the prompt's last position on.
    assert got["loss_mask"] == [[0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]]
    top = np.asarray(got["topk_ids"]).reshape(2, 7, 2)
    assert top[0, 2:4].tolist() == [[50, 51], [60, 61]] and top[1, :3].tolist() == [[70, 71], [80, 81], [90, 91]]
    assert (got["prompt_index"], got["teacher"]) == ([0, 1], [0, 1])
    assert got["mean_logprob"] == [-1.0, -1.0]


def test_an_answer_depends_on_its_own_seed_not_on_its_batch():
    """Sampled rows each from their own generator: the same tokens alone or batched with
    others (a rerun's batches may differ); soft targets are the model's top k at T."""
    from lmforge.inference.generate import generate_ids
    from lmforge.inference.sampling import SamplingParams
    from lmforge.models import PRESETS
    from lmforge.models.build import build_model

    model = build_model(PRESETS["tiny"].with_overrides(vocab_size=64), "cpu", seed=3).eval()
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_at_eos=False)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    batched = generate_ids(model, prompts, params, row_seeds=[11, 12, 13], soft_targets=(5, 2.0))
    alone = generate_ids(model, prompts[1:2], params, row_seeds=[12], soft_targets=(5, 2.0))[0]
    assert batched[1].tokens == alone.tokens
    assert generate_ids(model, prompts[1:2], params, row_seeds=[14])[0].tokens != alone.tokens
    with torch.no_grad():
        first = (model(torch.tensor([prompts[0]]))[0, -1] / 2.0).log_softmax(-1).topk(5)
    assert batched[0].top_ids[0].tolist() == first.indices.tolist()
    assert torch.allclose(batched[0].top_logprobs[0], first.values, atol=1e-5)
    assert batched[0].top_ids.shape == (6, 5)
