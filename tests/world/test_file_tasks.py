"""The user's own data: the ``files`` task (JSONL / Parquet rows, checked at load), its verifiers, and
prompts rendered with a model's chat template (exact token ids; trainer and vLLM agree on them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollhpc.tasks import files
from rollhpc.tasks.files import DataError, FileExample
from tests.support.processes import REPO, assert_no_orphans, rollhpc

ROWS = [
    {
        "question": f"What is {a} plus {b}?",
        "answer": str(a + b),
        "domain": "add" if a % 2 else "odd",
    }
    for a in range(10)
    for b in range(3)
]


def jsonl(path: Path, rows: list, raw: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + raw)
    return path


def half_credit(answer: str, reference: str) -> float:
    """A custom verifier, named by import path in the tests."""
    return 0.5 if answer.strip() else 0.0


def test_rows_become_examples_split_by_seed(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", ROWS)
    opts = dict(
        train=str(train),
        prompt_field="question",
        domain_field="domain",
        domain_verifiers={"odd": "exact"},
        heldout_fraction=0.2,
    )
    tr, held = files.make_splits(3, 0, 0, **opts)
    assert (
        len(tr) == 24 and len(held) == 6 and not {e.prompt for e in tr} & {e.prompt for e in held}
    )
    assert files.make_splits(3, 0, 0, **opts) == (tr, held)  # deterministic for a seed
    assert files.make_splits(4, 0, 0, **opts)[1] != held
    assert len(files.make_splits(3, 5, 2, **opts)[0]) == 5
    ex = next(e for e in tr if e.domain == "odd")
    assert ex.verifier == "exact" and ex.source.startswith("train.jsonl:")
    assert next(e for e in tr if e.domain == "add").verifier == "numeric"
    assert files.format_prompt(ex) == ex.prompt and files.completion(ex) == f" {ex.answer}"


@pytest.mark.parametrize(
    "rows, raw, message",
    [
        (
            [{"q": "x", "answer": "1"}],
            "",
            r"train.jsonl: line 1: no field 'question' \(fields: answer, q\)",
        ),
        ([], "", r"train.jsonl: no rows \(an empty dataset file\)"),
        (ROWS[:2], "{not json\n", r"train.jsonl: line 3 is not JSON"),
        (ROWS[:2], "[1, 2]\n", r"train.jsonl: line 3 is a JSON list, not an object"),
        ([{"question": "x", "answer": ""}], "", r"line 1: field 'answer' must be non-empty text"),
        ([{"question": None, "answer": "1"}], "", r"line 1: field 'question' is None, not text"),
    ],
)
def test_a_malformed_file_names_the_file_the_row_and_the_field(tmp_path, rows, raw, message):
    train = jsonl(tmp_path / "train.jsonl", rows, raw)
    with pytest.raises(DataError, match=message):
        files.make_splits(0, 0, 0, train=str(train), prompt_field="question")


def test_chat_messages_and_option_errors(tmp_path):
    chats = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": 4}]
    train = jsonl(tmp_path / "chat.jsonl", chats * 3)
    tr, held = files.make_splits(
        0, 0, 0, train=str(train), heldout=str(train), messages_field="messages", system="Be brief."
    )
    assert tr[0].prompt == "2+2?" and tr[0].answer == "4"
    assert tr[0].chat() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    bad = jsonl(
        tmp_path / "bad.jsonl",
        [{"messages": [{"role": "assistant", "content": "hi"}], "answer": 1}],
    )
    with pytest.raises(
        DataError, match=r"bad.jsonl: line 1: field 'messages': the last message must be the user's"
    ):
        files.make_splits(0, 0, 0, train=str(bad), messages_field="messages")
    for opts, message in [
        ({"train": ""}, "the training file is required"),
        ({"train": str(tmp_path / "nope.jsonl")}, "nope.jsonl: no such dataset file"),
        ({"train": str(train), "verifier": "fuzzy"}, "verifier 'fuzzy': use one of exact"),
        ({"train": str(train), "answer_regex": "####"}, "needs a group"),
        ({"train": str(tmp_path / "x.csv")}, "no such dataset file"),
    ]:
        with pytest.raises(DataError, match=message):
            files.make_splits(0, 0, 0, messages_field="messages", **opts)
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown file type '.csv'"):
        files.make_splits(0, 0, 0, train=str(csv))


def test_parquet_files_read_through_datasets(tmp_path):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    tr, held = files.make_splits(
        0,
        0,
        0,
        train=str(tmp_path / "train.parquet"),
        prompt_field="question",
        heldout_fraction=0.5,
    )
    assert len(tr) == len(held) == 15 and tr[0].source.startswith("train.parquet:")
    assert {e.prompt for e in tr + held} == {r["question"] for r in ROWS}


@pytest.mark.parametrize(
    "verifier, answer, response, want",
    [
        ("numeric", "1000", "It is 1,000.", 1.0),
        ("numeric", "7", "7 or maybe 8", 0.0),  # the last number is the answer
        ("exact", "Paris", "  Paris ", 1.0),
        ("exact", "Paris", "paris", 0.0),
        ("math", "7/8", "so \\boxed{0.875}", 1.0),
        ("tests.world.test_file_tasks:half_credit", "x", "anything", 0.5),
    ],
)
def test_verifiers(verifier, answer, response, want):
    assert files.score(FileExample(prompt="q", answer=answer, verifier=verifier), response) == want


def test_answer_regex_picks_the_answer_out_of_the_response():
    ex = FileExample(
        prompt="q", answer="72", verifier="numeric", answer_regex=r"####\s*(-?[\d,.]+)"
    )
    assert files.score(ex, "48 / 2 = 24 clips, 48 + 24 = 72 ... #### 72") == 1.0
    # group 1 is the answer, not the response's last number
    assert files.score(ex, "#### 70 then 72") == 0.0
    assert files.score(ex, "72 but no marker") == 0.0


def test_bad_data_stops_train_before_any_rank_starts(tmp_path):
    bad = jsonl(tmp_path / "train.jsonl", ROWS[:3], "{oops\n")
    res = rollhpc(
        "train",
        "jsonl_example",
        f"pipeline.options.task.options.train={bad}",
        f"pipeline.options.task.options.heldout={REPO / 'examples/word_problems/test.jsonl'}",
        cwd=tmp_path,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert f"{bad}: line 4 is not JSON" in res.stderr and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ chat templates
QWEN2_STYLE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny Qwen2 whose tokenizer has a Qwen2-style chat template and its two special tokens."""
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model

    rows = [
        json.loads(x)
        for x in (REPO / "examples" / "word_problems" / "train.jsonl").read_text().splitlines()
    ]
    tok = build_tokenizer(
        [f"{r['question']} {r['answer']}" for r in rows[:500]] + ["system user assistant"], 400
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN2_STYLE
    return create_tiny_model(tmp_path_factory.mktemp("chat") / "tiny-chat", TinyModelConfig(), tok)


def test_prompts_render_with_the_models_chat_template(chat_model):
    from transformers import AutoTokenizer

    from rollhpc.rollout.prompts import PromptRenderer

    tok = AutoTokenizer.from_pretrained(chat_model)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ex = FileExample(
        prompt="Mia has 3 pens. How many pens does Mia have?", answer="3", system="Be brief."
    )

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    want = (
        [start]
        + enc("system\nBe brief.")
        + [end]
        + enc("\n")
        + [start]
        + enc("user\n" + ex.prompt)
        + [end]
        + enc("\n")
        + [start]
        + enc("assistant\n")
    )
    render = PromptRenderer(tok)
    assert render.uses_template and render(ex) == want
    assert render.text(ex).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert PromptRenderer(tok, "off")(ex) == tok.encode(ex.prompt)  # plain text when asked
    plain = AutoTokenizer.from_pretrained(chat_model)
    plain.chat_template = None
    assert not PromptRenderer(plain).uses_template
    with pytest.raises(ValueError, match="has no chat template"):
        PromptRenderer(plain, "on")


@pytest.mark.slow
def test_chat_template_prompts_train_in_sync_with_vllm(chat_model, tmp_path):
    """The jsonl_example run on the chat-template model: prompts reach vLLM and the trainer in the template,
    and both give the same log-probs for the responses; --dry-run shows the rendered prompts first."""
    from rollhpc.observability.rollouts import read_rollouts

    args = [
        f"pipeline.options.model_dir={chat_model}",
        "pipeline.options.warm_start=null",
        f"pipeline.options.task.options.train={REPO / 'examples/word_problems/train.jsonl'}",
        f"pipeline.options.task.options.heldout={REPO / 'examples/word_problems/test.jsonl'}",
        "pipeline.options.task.n_heldout=16",
        "pipeline.options.steps=2",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.loss.entropy_coef=0.01",
    ]
    dry = rollhpc("train", "jsonl_example", *args, "--dry-run", cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert (
        "prompts (in the model's chat template)" in dry.stdout
        and "<|im_start|>user\n" in dry.stdout
    )
    # every prompt of both splits measured against the generator's context: one that leaves no room is refused
    lengths = re.search(
        r"training: (\d+) prompts, the longest (\d+) tokens \+ rollout.max_tokens 8 of "
        r"max_model_len 96; held-out: 16 prompts",
        dry.stdout,
    )
    assert lengths, dry.stdout[-2000:]
    longest = int(lengths[2])
    short = rollhpc(
        "train",
        "jsonl_example",
        *args,
        f"roles.generate.options.max_model_len={longest + 7}",
        "--dry-run",
        cwd=tmp_path,
        timeout=60,
    )
    assert short.returncode == 2 and short.stderr.count("\n") == 1, short.stderr
    assert (
        f"is {longest} tokens: with pipeline.options.rollout.max_tokens=8 it needs {longest + 8} > "
        f"roles.generate.options.max_model_len={longest + 7}"
    ) in short.stderr, short.stderr
    res = rollhpc("train", "jsonl_example", *args, cwd=tmp_path, timeout=600)
    run_dir = tmp_path / "runs" / "jsonl_example"
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [x["step"] for x in steps] == [1, 2]
    assert all(x["logprob_abs_diff"] < 1e-4 and x["train/grad_norm"] > 0 for x in steps), steps
    from transformers import AutoTokenizer

    start = AutoTokenizer.from_pretrained(chat_model).convert_tokens_to_ids("<|im_start|>")
    prompts = read_rollouts(run_dir / "rollouts" / "step_000002.h5")["prompt_tokens"]
    assert len(prompts) and all(p[0] == start for p in prompts)
    assert_no_orphans(run_dir)


def test_dataset_files_that_are_not_here_stop_train_but_not_plan(tmp_path):
    """A config for the cluster's data plans on a laptop (with a warning); train refuses it at once."""
    gone = "pipeline.options.task.options.train=/cluster/data/train.jsonl"
    res = rollhpc("plan", "jsonl_example", gone, "--no-ranks", cwd=tmp_path, timeout=60)
    assert res.returncode == 0 and "no dataset file at /cluster/data/train.jsonl" in res.stderr, (
        res.stderr
    )
    res = rollhpc("train", "jsonl_example", gone, cwd=tmp_path, timeout=60)
    assert (
        res.returncode == 2
        and "pipeline.options.task.options.train: no dataset file at" in res.stderr
    )
