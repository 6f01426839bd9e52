"""An example's prompt as the token ids the policy sees: its chat template, or plain text.

Instruction-tuned checkpoints (Qwen2.5-Instruct, Llama-3-Instruct, Qwen3) were trained on conversations
in their own chat template; a bare question gets them out of distribution. So when the tokenizer has a
template (``tokenizer.chat_template``) and the pipeline's ``chat_template`` option is ``auto`` (or ``on``),
the example's conversation is rendered with ``apply_chat_template(..., add_generation_prompt=True)``: the
task's system prompt, its messages (or its prompt as the one user turn), then the assistant's header, so
the response is the assistant's turn. Without a template (the tiny models of the quickstart) the prompt
is the task's plain text, encoded as the tokenizer encodes any text. An example offers ``chat()`` (a
list of role/content dicts) to give more than one user turn; otherwise ``prompt`` is the user turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ChatTemplateMode = Literal["auto", "on", "off"]


class PromptExample(Protocol):
    """A task example as a prompt: its text (the one user turn); it may also offer ``chat()``, a list of
    role/content dicts, for more than one turn."""

    prompt: str


class PromptRenderer:
    """``renderer(example) -> token ids``; ``renderer.text(example)``: the same prompt as text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, mode: ChatTemplateMode = "auto"):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"chat_template must be auto, on or off, got {mode!r}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if mode == "on" and not has_template:
            raise ValueError(
                f"chat_template=on, but the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has "
                "no chat template (set chat_template=auto or off for plain-text prompts)"
            )
        self.tokenizer = tokenizer
        self.uses_template = has_template and mode != "off"

    @staticmethod
    def conversation(example: PromptExample) -> list[dict[str, str]]:
        chat = getattr(example, "chat", None)
        return chat() if callable(chat) else [{"role": "user", "content": example.prompt}]

    def text(self, example: PromptExample) -> str:
        if not self.uses_template:
            return example.prompt
        return str(
            self.tokenizer.apply_chat_template(
                self.conversation(example), tokenize=False, add_generation_prompt=True
            )
        )

    def __call__(self, example: PromptExample) -> list[int]:
        if not self.uses_template:
            return list(self.tokenizer.encode(example.prompt))
        # the template writes the special tokens itself: none added around it
        return list(self.tokenizer.encode(self.text(example), add_special_tokens=False))

    def lengths(self, examples: Sequence[PromptExample]) -> list[int]:
        """Token counts of many prompts, encoded in one batch call (the same ids ``__call__`` gives)."""
        if not examples:
            return []
        if not self.uses_template:
            return [len(ids) for ids in self.tokenizer([ex.prompt for ex in examples])["input_ids"]]
        texts = [self.text(ex) for ex in examples]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def check_prompt_budget(
    render: PromptRenderer,
    splits: Sequence[tuple[str, Sequence[PromptExample], str, int]],
    max_model_len: int | None,
) -> str:
    """The generator's context holds a prompt and its response: every prompt plus its split's response budget
    must fit ``max_model_len``, or a request fails (or is cut) only once it is drawn, hours into a run.

    ``splits``: (name, examples, budget key, max new tokens), e.g. ("training", train, "rollout.max_tokens", 64).
    Returns one line on the longest prompt of each split; raises ValueError (one line, the example named)
    when one does not fit."""
    lines = []
    for name, examples, key, max_tokens in splits:
        counts = render.lengths(examples)
        if not counts:
            continue
        i = max(range(len(counts)), key=counts.__getitem__)
        if max_model_len and counts[i] + max_tokens > max_model_len:
            too_long = sum(n + max_tokens > max_model_len for n in counts)
            raise ValueError(
                f"the longest {name} prompt ({name} example {i}, {getattr(examples[i], 'prompt', '')[:40]!r}...) is "
                f"{counts[i]} tokens: with pipeline.options.{key}={max_tokens} it needs {counts[i] + max_tokens} > "
                f"roles.generate.options.max_model_len={max_model_len} ({too_long} of {len(counts)} {name} prompts "
                f"do not fit): raise max_model_len, lower {key} or drop the long prompts"
            )
        lines.append(
            f"{name}: {len(counts)} prompts, the longest {counts[i]} tokens + {key} {max_tokens}"
            + (f" of max_model_len {max_model_len}" if max_model_len else "")
        )
    return "; ".join(lines)
