"""Turn formatters: the text that goes between the policy's turns of a multi-turn episode.

A row of an episode is ``prompt || r1 || o2 || r2 || ...``: the first prompt (instruction and first
observation), then each generated response as the generator produced it (token ids, never re-encoded),
each followed by the next observation's text. A formatter says what that text is; the env role
encodes it and appends the ids, so the row grows by concatenation only.

``PlainTextTurns`` is the format of the tiny models (no chat template): the policy answers after a
``>`` marker and its response ends with EOS::

    Reach the goal G ...        <- instruction
    P.H.                        <- observation
    ...
    > right<EOS>                <- generated
    ...                         <- next observation
    >

``ChatTemplateTurns`` is the format of Hugging Face chat models: the text between two responses is what
the tokenizer's chat template puts there, found as the difference between renders of a conversation with
and without the new turn. Concatenating turns is only faithful to the template if rendering a conversation
message by message gives the same text, and tokenizing turn by turn the same ids, as rendering and
tokenizing it whole; the constructor checks exactly that and refuses templates that rewrite earlier turns.
Encode a formatter's text with ``tokenizer.encode(text, add_special_tokens=False)``: the template already
holds whatever BOS or role tokens it wants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TurnFormatter", "PlainTextTurns", "ChatTemplateTurns"]


class TurnFormatter(Protocol):
    def first(self, instruction: str, observation: str) -> str:
        """The text of the episode's prompt."""
        ...

    def next(self, observation: str) -> str:
        """The text appended after a response: the environment's next observation and the answer marker."""
        ...

    def action(self, response_text: str) -> str:
        """The action the environment is given, from the decoded response (special tokens removed)."""
        ...


class PlainTextTurns:
    """Plain text: instruction, observation, ``>``; the answer is the stripped response text."""

    marker = ">"

    def first(self, instruction: str, observation: str) -> str:
        head = f"{instruction}\n" if instruction else ""
        return f"{head}{observation}\n{self.marker}"

    def next(self, observation: str) -> str:
        return f"\n{observation}\n{self.marker}"

    def action(self, response_text: str) -> str:
        return response_text.strip()


def _first_difference(a: str, b: str) -> str:
    """Where two texts part, for error messages: the character index and what each holds from there."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"they part at character {i}: {a[i : i + 40]!r} vs {b[i : i + 40]!r}"


class ChatTemplateTurns:
    """Turns in a Hugging Face chat template (``<|im_start|>``-style templates, or any other that renders a
    conversation as a growing prefix), with an optional system prompt.

    The generator stops on ``eos_token`` (default: the tokenizer's), which must be how the template starts
    the end of an assistant message (``<|im_end|>`` in ``<|im_end|>\\n``): a response that stopped already
    ends with it, so ``next`` appends only the rest of the end of turn; one cut by its budget gets all of it.
    """

    # The conversation the constructor checks the template on. The responses carry <think> blocks so that a
    # template that strips reasoning from earlier turns (Qwen3's does) is caught here rather than in training.
    PROBE_INSTRUCTION = "Probe instruction: reach the goal."
    PROBE_OBSERVATIONS = ("probe observation 1", "probe observation 2", "probe observation 3")
    PROBE_RESPONSES = (
        "<think>\nprobe reasoning 1\n</think>\n\nprobe answer 1",
        "<think>\nprobe reasoning 2\n</think>\n\nprobe answer 2",
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        system: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat_template; use PlainTextTurns for a model without one"
            )
        self.tokenizer = tokenizer
        self.system = system
        self.eos: str = eos_token if eos_token is not None else (tokenizer.eos_token or "")
        eos_ids = tokenizer.encode(self.eos, add_special_tokens=False)
        if len(eos_ids) != 1:
            raise ValueError(
                f"the generator's stop token {self.eos!r} is not one token of this tokenizer (it "
                f"encodes to {eos_ids}); pass eos_token= the token that ends an assistant turn"
            )
        self.eos_id: int = eos_ids[0]
        # what the template puts after an assistant message's content
        self.end_of_turn = self._end_of_turn()
        self.verify(self.PROBE_INSTRUCTION, self.PROBE_OBSERVATIONS, self.PROBE_RESPONSES)

    def first(self, instruction: str, observation: str) -> str:
        """The template's render of [system?, user(instruction, observation)] with the generation prompt."""
        return self._render(self._messages(instruction, [observation], []))

    def next(self, observation: str, stopped: bool = True) -> str:
        """The text after a response: the rest of the assistant message's end, the user turn, the generation prompt.

        Found as the difference between renders of a conversation with and without the new user message.
        ``stopped=False`` (the response hit its budget before the stop token) puts the whole end of turn,
        stop token included, so the row still reads as a closed assistant message.
        """
        msgs = self._messages(
            self.PROBE_INSTRUCTION,
            [self.PROBE_OBSERVATIONS[0], observation],
            self.PROBE_RESPONSES[:1],
        )
        before, after = self._render(msgs[:-1]), self._render(msgs)
        if not after.startswith(before):
            raise ValueError(self._changed(msgs[:-1], before, after))
        closing = self.end_of_turn[len(self.eos) :] if stopped else self.end_of_turn
        return closing + after[len(before) :]

    def action(self, response_text: str) -> str:
        """The answer after any reasoning: the text after the last ``</think>``, stripped."""
        return response_text.rsplit("</think>", 1)[-1].strip()

    def verify(
        self, instruction: str, observations: Sequence[str], responses: Sequence[str]
    ) -> None:
        """Raise ValueError unless building this conversation turn by turn, as rows are built, gives exactly
        the text and the token ids of rendering it whole and encoding that at once.

        ``observations`` has one more entry than ``responses``. A response's ids are its own encoding followed
        by the stop token, as from a generator that stopped. The error names the template behaviour at fault.
        """
        if len(observations) != len(responses) + 1:
            raise ValueError(
                f"verify needs one observation more than responses, got {len(observations)} and "
                f"{len(responses)}"
            )
        msgs = self._messages(instruction, observations, responses)
        # add the messages after the first user one
        for n in range(1 if self.system is None else 2, len(msgs)):
            if msgs[n]["role"] == "assistant":
                end = self._assistant_end(msgs[: n + 1])
                if end != self.end_of_turn:
                    turn = sum(m["role"] == "assistant" for m in msgs[: n + 1])
                    raise ValueError(
                        f"the chat template ends assistant messages differently in different turns "
                        f"({end!r} in turn {turn}, {self.end_of_turn!r} in the first)"
                    )
                continue
            before, after = self._render(msgs[:n]), self._render(msgs[: n + 1])
            if not after.startswith(before):
                raise ValueError(self._changed(msgs[:n], before, after))
        text = self.first(instruction, observations[0])
        ids = self._encode(text)
        for response, observation in zip(responses, observations[1:]):
            appended = self.next(observation)
            text += response + self.eos + appended
            ids += self._encode(response) + [self.eos_id] + self._encode(appended)
        whole = self._render(msgs)
        if text != whole:
            raise ValueError(
                "rendering the conversation turn by turn differs from rendering it whole "
                f"({_first_difference(text, whole)})"
            )
        whole_ids = self._encode(whole)
        if ids != whole_ids:
            i = next(
                (j for j, (x, y) in enumerate(zip(ids, whole_ids)) if x != y),
                min(len(ids), len(whole_ids)),
            )
            tokens = self.tokenizer.convert_ids_to_tokens
            raise ValueError(
                "encoding the conversation turn by turn gives other token ids than encoding it whole "
                f"(from token {i}: {tokens(ids[i : i + 4])} vs {tokens(whole_ids[i : i + 4])}): the "
                "tokenizer merges characters across a turn boundary of this template, so rows would "
                "hold token sequences the model never reads in a rendered conversation"
            )

    def _messages(
        self, instruction: str, observations: Sequence[str], responses: Sequence[str]
    ) -> list[dict[str, str]]:
        """[system?, user(instruction + first observation), assistant(r1), user(o2), assistant(r2), ...]."""
        msgs = [] if self.system is None else [{"role": "system", "content": self.system}]
        first = f"{instruction}\n\n{observations[0]}" if instruction else observations[0]
        msgs.append({"role": "user", "content": first})
        for k, response in enumerate(responses):
            msgs.append({"role": "assistant", "content": response})
            if k + 1 < len(observations):
                msgs.append({"role": "user", "content": observations[k + 1]})
        return msgs

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool | None = None) -> str:
        """The template's text; by default a conversation that ends with a user message gets the generation
        prompt (the policy answers next) and one that ends with an assistant message does not."""
        if generation_prompt is None:
            generation_prompt = messages[-1]["role"] != "assistant"
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=generation_prompt
                )
            )
        except Exception as e:  # jinja errors and raise_exception() calls of the template itself
            roles = ", ".join(m["role"] for m in messages)
            raise ValueError(
                f"the chat template cannot render a conversation of [{roles}]: {e}"
            ) from e

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _end_of_turn(self) -> str:
        """What follows an assistant message's content in the template, checked to start with the stop token."""
        msgs = self._messages(
            self.PROBE_INSTRUCTION, self.PROBE_OBSERVATIONS[:1], self.PROBE_RESPONSES[:1]
        )
        end = self._assistant_end(msgs)
        if not end.startswith(self.eos):
            raise ValueError(
                f"the chat template ends an assistant message with {end!r}, which does not start with "
                f"the generator's stop token {self.eos!r}: a response that stopped would end with a "
                "token the template never renders there; pass eos_token= the token that closes an "
                "assistant turn (e.g. '<|im_end|>')"
            )
        return end

    def _assistant_end(self, msgs: list[dict[str, str]]) -> str:
        """What the template puts after the content of ``msgs``' last (assistant) message.

        Raises unless that render is the conversation before it, then the generation prompt, then the content
        verbatim: exactly what a row holds after the generator answered the generation prompt.
        """
        history = self._render(msgs[:-1], generation_prompt=False)
        head = self._render(msgs[:-1]) + msgs[-1]["content"]
        full = self._render(msgs)
        if not full.startswith(history):
            raise ValueError(self._changed(msgs[:-1], history, full))
        if not full.startswith(head):
            raise ValueError(self._not_verbatim(head, full))
        return full[len(head) :]

    @staticmethod
    def _changed(earlier: list[dict[str, str]], before: str, after: str) -> str:
        """The error for a render of n+1 messages that does not extend the render of the first n."""
        where = _first_difference(before, after)
        if any(m["content"] not in after for m in earlier if m["role"] == "assistant"):
            return (
                "the chat template rewrites earlier assistant messages: their text changes once a later "
                f"message follows (for example <think> blocks stripped from earlier turns; {where}). A row "
                "keeps every generated token as generated, so it would no longer be the conversation the "
                "template renders; use a template that renders history verbatim"
            )
        n = len(earlier)
        return (
            f"the chat template changes earlier text when a message is added: rendering {n} message"
            f"{'s' if n != 1 else ''} is not a prefix of rendering {n + 1} ({where}); rows grow by appending, "
            "so each turn must leave the text before it as it was"
        )

    @staticmethod
    def _not_verbatim(expected: str, rendered: str) -> str:
        return (
            "the chat template does not render an assistant message as its generation prompt followed by the "
            "response verbatim (it trims, reformats or parses the content, or opens assistant messages "
            f"otherwise than add_generation_prompt=True does; {_first_difference(expected, rendered)}): "
            "generated tokens would not match the rendered conversation"
        )
