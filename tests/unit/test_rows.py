"""The episode record and the multi-turn rows made from it token by token (rollhpc.rollout.episode, .rows), and the
chat-template turn formatter."""

import numpy as np
import pytest

from rollhpc.rollout.episode import Episode, Turn
from rollhpc.rollout.rows import (
    pad_routes,
    pad_rows,
    response_row,
    step_rows,
    trajectory_row,
    turn_budget,
)
from rollhpc.rollout.turns import ChatTemplateTurns, PlainTextTurns


def two_turns() -> Episode:
    # prompt 10 11 12 | r1 20 21 | o2 30 31 32 | r2 40 41 42 | (o3 50 51: after the last turn, never in a row)
    # row index:  0  1  2 | 3  4 | 5  6  7 | 8  9  10
    return Episode(
        prompt=[10, 11, 12],
        group=7,
        index=1,
        seed=99,
        finish="terminated",
        success=True,
        turns=[
            Turn(
                response=[20, 21],
                logprobs=[-0.5, -0.25],
                version=3,
                observation=[30, 31, 32],
                reward=0.5,
                state_key="s0",
            ),
            Turn(
                response=[40, 41, 42],
                logprobs=[-1.0, -2.0, -4.0],
                version=4,
                observation=[50, 51],
                reward=1.0,
                state_key="s1",
            ),
        ],
    )


def test_trajectory_row_token_by_token():
    row = trajectory_row(two_turns())
    np.testing.assert_array_equal(row.tokens, [10, 11, 12, 20, 21, 30, 31, 32, 40, 41, 42])
    # position i predicts tokens[i+1]: generated tokens sit at row 3, 4, 8, 9, 10 -> positions 2, 3, 7, 8, 9
    np.testing.assert_array_equal(row.loss_mask, [0, 0, 1, 1, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(row.gen_logprob, [0, 0, -0.5, -0.25, 0, 0, 0, -1.0, -2.0, -4.0])
    # each turn's reward on its last generated token: r1 ends at row 4 (position 3), r2 at row 10 (position 9)
    np.testing.assert_array_equal(row.token_rewards, [0, 0, 0, 0.5, 0, 0, 0, 0, 0, 1.0])
    np.testing.assert_array_equal(row.turn_ids, [-1, -1, 0, 0, -1, -1, -1, 1, 1, 1])
    assert (
        row.tokens.dtype == np.int64
        and row.loss_mask.dtype == np.float32
        and row.turn_ids.dtype == np.int32
    )


def test_row_follows_rlvr_shift_for_a_single_turn():
    # one turn and no observation is RLVR's row: mask[p-1 : p-1+r] = 1 for p=2 prompt tokens, r=3 response tokens
    traj = Episode(
        prompt=[1, 2],
        turns=[Turn(response=[5, 6, 0], logprobs=[-1.0, -1.0, -1.0], version=0, reward=2.0)],
    )
    row = trajectory_row(traj)
    # the EOS (id 0) stays: the policy generated it
    np.testing.assert_array_equal(row.tokens, [1, 2, 5, 6, 0])
    np.testing.assert_array_equal(row.loss_mask, [0, 1, 1, 1])
    np.testing.assert_array_equal(row.token_rewards, [0, 0, 0, 2.0])


def test_step_rows_mask_one_turn_in_its_context():
    first, second = step_rows(two_turns())
    np.testing.assert_array_equal(first.tokens, [10, 11, 12, 20, 21])
    np.testing.assert_array_equal(first.loss_mask, [0, 0, 1, 1])
    np.testing.assert_array_equal(first.gen_logprob, [0, 0, -0.5, -0.25])
    np.testing.assert_array_equal(first.token_rewards, [0, 0, 0, 0.5])
    np.testing.assert_array_equal(first.turn_ids, [-1, -1, 0, 0])
    # the second row's context holds r1 as generated, but only r2 is masked in
    np.testing.assert_array_equal(second.tokens, [10, 11, 12, 20, 21, 30, 31, 32, 40, 41, 42])
    np.testing.assert_array_equal(second.loss_mask, [0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(second.gen_logprob, [0, 0, 0, 0, 0, 0, 0, -1.0, -2.0, -4.0])
    np.testing.assert_array_equal(second.token_rewards, [0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0])
    np.testing.assert_array_equal(second.turn_ids, [-1] * 7 + [1, 1, 1])


def test_pad_rows_right_pads_like_rlvr():
    rows = step_rows(two_turns())
    batch = pad_rows(rows, pad_id=1)
    assert set(batch) == {"tokens", "loss_mask", "gen_logprob", "token_rewards", "turn_ids"}
    np.testing.assert_array_equal(
        batch["tokens"],
        [[10, 11, 12, 20, 21, 1, 1, 1, 1, 1, 1], [10, 11, 12, 20, 21, 30, 31, 32, 40, 41, 42]],
    )
    np.testing.assert_array_equal(
        batch["loss_mask"], [[0, 0, 1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]]
    )
    np.testing.assert_array_equal(batch["gen_logprob"][0], [0, 0, -0.5, -0.25, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["token_rewards"][0], [0, 0, 0, 0.5, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["turn_ids"][0], [-1, -1, 0, 0, -1, -1, -1, -1, -1, -1])
    assert batch["tokens"].dtype == np.int64 and batch["gen_logprob"].dtype == np.float32
    with pytest.raises(ValueError, match="at least one row"):
        pad_rows([], pad_id=1)


def test_turn_budget_and_truncation():
    assert turn_budget(row_len=10, per_turn_cap=8, max_model_len=100) == 8  # the cap binds
    assert turn_budget(row_len=95, per_turn_cap=8, max_model_len=100) == 5  # the context binds
    # full: the episode ends truncated
    assert turn_budget(row_len=100, per_turn_cap=8, max_model_len=100) == 0
    # an observation overflowed
    assert turn_budget(row_len=103, per_turn_cap=8, max_model_len=100) == -3
    with pytest.raises(ValueError, match="per_turn_cap"):
        turn_budget(10, 0, 100)


def test_a_row_full_episode_fits_the_context():
    # max_model_len 12: prompt 3 + r1 2 + o2 3 = 8 -> budget 4; r2 takes 4 -> row 12; o3 (2 tokens) makes 14 ->
    # budget -2: truncated. The row leaves the overflowing observation out and fits in 12 tokens.
    traj = two_turns()
    assert turn_budget(len(traj.prompt) + 5, 16, 12) == 4
    traj.turns[1] = Turn(
        response=[40, 41, 42, 43], logprobs=[-1.0] * 4, version=4, observation=[50, 51]
    )
    traj.finish = "truncated"
    assert traj.length == 14 and turn_budget(traj.length, 16, 12) == -2
    assert len(trajectory_row(traj).tokens) == 12


def test_trajectory_record_properties_and_validation():
    traj = two_turns()
    assert traj.episode_return == 1.5 and traj.version == 3 and traj.length == 3 + 2 + 3 + 3 + 2
    with pytest.raises(ValueError, match="logprobs"):
        Turn(response=[1, 2], logprobs=[0.0], version=0)
    # a record may lack ids, a row may not
    with pytest.raises(ValueError, match="at least one generated token"):
        trajectory_row(
            Episode(prompt=[1], turns=[Turn(response=[], logprobs=[], version=0, action="left")])
        )
    with pytest.raises(ValueError, match="no prompt ids"):
        step_rows(Episode(turns=[Turn(action="left", observation_text="P.")]))
    with pytest.raises(ValueError, match="finish must be one of"):
        Episode(prompt=[1], finish="done")
    Episode(prompt=[1], finish="error: env step timed out after 30 s")
    with pytest.raises(ValueError, match="no turns"):
        trajectory_row(Episode(prompt=[1], finish="error: reset failed"))
    with pytest.raises(ValueError, match="no turns"):
        step_rows(Episode(prompt=[1]))


# ---- the chat-template formatter, with a tokenizer trained here (nothing is downloaded) ----

QWEN_STYLE = (  # Qwen2.5's layout: a default system prompt, <|im_start|>role\ncontent<|im_end|>\n per message
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

STRIPS_THINK = (  # Qwen3's habit: assistant messages before the last user message lose their <think> block
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and loop.index0 < ns.last_user %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

COUNTS_MESSAGES = (  # a system line that changes with every message added
    "{{- '<|im_start|>system\\nA conversation of ' + (messages | length | string) + ' messages.<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PLAIN_ROLES = (  # no special tokens between turns: "assistant: " then the response, which BPE merges across
    "{%- for message in messages %}"
    "{{- message.role + ': ' + message.content }}"
    "{%- if message.role == 'assistant' %}{{- '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from rollhpc.warm_start.tiny import build_tokenizer

    probe = [
        ChatTemplateTurns.PROBE_INSTRUCTION,
        *ChatTemplateTurns.PROBE_OBSERVATIONS,
        *ChatTemplateTurns.PROBE_RESPONSES,
    ]
    corpus = [
        *probe,
        "You are a helpful assistant.",
        "system user assistant: <think> probe answer left right",
        "the agent is at P and the goal at G",
    ] * 20
    tok = build_tokenizer(corpus, vocab_size=400)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    return tok


def with_template(tok, template: str):
    tok.chat_template = template
    return tok


def test_chat_template_turns_incremental_equals_whole(tokenizer):
    tok = with_template(tokenizer, QWEN_STYLE)
    # the constructor already ran verify on its probe
    turns = ChatTemplateTurns(tok, eos_token="<|im_end|>")
    assert turns.end_of_turn == "<|im_end|>\n"
    assert turns.first("Reach G.", "P.G") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nReach G.\n\nP.G<|im_end|>\n<|im_start|>assistant\n"
    )
    # after a response that stopped on <|im_end|>: the rest of the end of turn, the user turn, the generation prompt
    assert turns.next(".PG") == "\n<|im_start|>user\n.PG<|im_end|>\n<|im_start|>assistant\n"
    assert (
        turns.next(".PG", stopped=False)
        == "<|im_end|>\n<|im_start|>user\n.PG<|im_end|>\n<|im_start|>assistant\n"
    )
    assert turns.action("<think>\nleft is closer\n</think>\n\n right ") == "right"

    # a row built as the env role builds it (responses as generated ids, observations appended) is exactly the
    # whole conversation rendered by the template and encoded at once
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    row = (
        enc(turns.first("Reach G.", "P.G"))
        + enc("left")
        + [eos]
        + enc(turns.next(".PG"))
        + enc("right")
        + [eos]
        + enc(turns.next("..G"))
    )
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "Reach G.\n\nP.G"},
            {"role": "assistant", "content": "left"},
            {"role": "user", "content": ".PG"},
            {"role": "assistant", "content": "right"},
            {"role": "user", "content": "..G"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert row == enc(whole)
    turns.verify("Reach G.", ["P.G", ".PG", "..G"], ["left", "<think>\nstill\n</think>\nright"])


def test_chat_template_turns_with_system_prompt(tokenizer):
    turns = ChatTemplateTurns(
        with_template(tokenizer, QWEN_STYLE), system="Play well.", eos_token="<|im_end|>"
    )
    assert turns.first("", "P.G") == (
        "<|im_start|>system\nPlay well.<|im_end|>\n"
        "<|im_start|>user\nP.G<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_refuses_rewriting_templates(tokenizer):
    with pytest.raises(ValueError, match="rewrites earlier assistant messages"):
        ChatTemplateTurns(with_template(tokenizer, STRIPS_THINK), eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="changes earlier text when a message is added"):
        ChatTemplateTurns(with_template(tokenizer, COUNTS_MESSAGES), eos_token="<|im_end|>")


def test_chat_template_refuses_a_stop_token_that_does_not_close_turns(tokenizer):
    # the tiny tokenizer's EOS is <|endoftext|>, but the template closes assistant messages with <|im_end|>
    with pytest.raises(ValueError, match="does not start with the generator's stop token"):
        ChatTemplateTurns(with_template(tokenizer, QWEN_STYLE))


def test_chat_template_refuses_token_merges_across_turns(tokenizer):
    # the text matches, but "assistant: " + "<think>" encodes as [" ", "<"] turn by turn and [" <"] whole
    with pytest.raises(ValueError, match="other token ids than encoding it whole"):
        ChatTemplateTurns(with_template(tokenizer, PLAIN_ROLES), eos_token="<|im_end|>")


def test_chat_template_needs_a_template(tokenizer):
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplateTurns(with_template(tokenizer, None))  # type: ignore[arg-type]


def test_plain_text_turns_unchanged():
    turns = PlainTextTurns()
    assert (
        turns.first("Reach G.", "P.G") + "right" + turns.next(".PG")
        == "Reach G.\nP.G\n>right\n.PG\n>"
    )


def test_a_response_row_pads_like_an_episode_row():
    """RLVR's sampled responses go through the same rows and padding as episodes: the response masked in at the
    positions that predict it, with its log-probs; an empty response trains on nothing."""
    rows = [response_row([7, 8, 9], [4, 5], [-0.5, -0.25]), response_row([7, 8], [], [])]
    batch = pad_rows(rows, pad_id=0)
    np.testing.assert_array_equal(batch["tokens"], [[7, 8, 9, 4, 5], [7, 8, 0, 0, 0]])
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 1, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["gen_logprob"], [[0, 0, -0.5, -0.25], [0, 0, 0, 0]])


def test_pad_routes_keeps_each_fed_tokens_experts_and_marks_the_rest():
    from rollhpc.engines.completion import Completion
    from rollhpc.rollout.types import Prompt, Sample

    # a 3-token prompt and a 2-token response: 4 tokens fed, in 2 MoE layers of top-2
    fed = np.arange(16, dtype=np.int16).reshape(4, 2, 2)
    sample = Sample(Prompt(uid=0, tokens=(5, 6, 7), example=None), 0)
    sample.add_segment(Completion([8, 9], [-0.1, -0.2], "stop", 0, routes=fed))
    other = np.zeros((2, 2, 2), dtype=np.int16)  # a 2-token prompt, one token: 2 fed
    out = pad_routes([sample.routes, other], width=5)
    assert out.shape == (2, 5, 2, 2) and out.dtype == np.int16
    np.testing.assert_array_equal(out[0, :4], fed)
    assert (out[0, 4] == -1).all() and (out[1, 2:] == -1).all() and (out[1, :2] == 0).all()
    assert pad_routes([fed, None], 5) is None  # a row without routes: nothing to replay
    with pytest.raises(ValueError, match="do not fit"):
        pad_routes([fed, np.zeros((3, 3, 2), np.int16)], 5)  # three layers where the rows have two
