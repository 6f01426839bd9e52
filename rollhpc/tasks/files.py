"""A task from the user's own files: prompts (or chat messages) with answers, in JSONL or Parquet.

Options (``pipeline.options.task.options`` with ``task.name: files``)::

    train: data/train.jsonl          # .jsonl / .json (one object per line) or .parquet; local paths only
    heldout: data/test.jsonl         # optional; without it heldout_fraction of train is held out
    heldout_fraction: 0.1
    prompt_field: question           # the prompt text ...
    messages_field: ""               # ... or a list of {"role", "content"} chat messages (one of the two)
    answer_field: answer             # the reference answer (a string or a number)
    domain_field: ""                 # optional: the row's domain, which picks its verifier
    system: ""                       # a system prompt added to every chat (when the model has a template)
    verifier: numeric                # exact | numeric | math | package.module:function(response, answer)
    domain_verifiers: {}             # domain -> verifier, for rows of that domain
    answer_regex: ""                 # the answer is the first group of its last match in the response
                                     # (e.g. "####\\s*(.+)"); empty: the verifier's own extraction

Verifiers: ``exact`` compares the extracted text with the answer after trimming whitespace; ``numeric``
compares the response's last number with the answer as numbers (``1,000`` = ``1000.0``); ``math`` is
math-verify (``rollhpc.rewards.math_verify``: boxed answers, fractions, LaTeX); an import path names
a function ``f(response_text, answer) -> float``. Files are read here and nowhere else, before any rank
starts: a malformed row (not JSON, a missing or empty field, messages that are not a list of role/content
objects) raises one ``DataError`` naming the file, the row (1-based line number for JSONL) and the field.
Parquet goes through Hugging Face ``datasets`` with no network access. Examples keep their file and row
(``source``), so a suspicious reward can be traced to the data.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollhpc.rewards.math_verify import score_answer

VERIFIERS = ("exact", "numeric", "math")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class DataError(ValueError):
    """A dataset file that cannot be used as given: which file, which row, which field, and why."""


@dataclass(frozen=True)
class FileExample:
    prompt: str  # the plain-text prompt (for chat messages: the last user message)
    answer: str
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) pairs when the row gave a chat
    system: str = ""
    domain: str = ""
    verifier: str = "numeric"
    answer_regex: str = ""
    source: str = ""  # "FILE:ROW"

    def chat(self) -> list[dict[str, str]]:
        """The conversation to render with a chat template: the row's messages, or its prompt as the one
        user turn; the system prompt first unless the messages already have one."""
        messages = [{"role": r, "content": c} for r, c in self.messages] or [
            {"role": "user", "content": self.prompt}
        ]
        if self.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        return messages


def format_prompt(example: FileExample) -> str:
    """The prompt as plain text (models without a chat template continue it directly)."""
    return example.prompt


def completion(example: FileExample) -> str:
    """The reference continuation, for an SFT warm start (EOS is the tokenizer's business)."""
    return f" {example.answer}"


def reference(example: FileExample) -> str:
    """The answer a judge is shown (``rollhpc.rewards.judge.judge_fields``)."""
    return example.answer


def corpus(examples: Iterable[FileExample]) -> Iterator[str]:
    """Prompt + answer texts, for a tokenizer and an SFT warm start."""
    for ex in examples:
        yield format_prompt(ex) + completion(ex)


# ---------------------------------------------------------------- reading
def _rows(path: Path) -> Iterator[tuple[str, Mapping[str, object]]]:
    """(row label, row) of a JSONL or Parquet file; a line that is not a JSON object is a DataError."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DataError(
                        f"{path}: line {n} is not JSON ({e.msg} at column {e.colno})"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"{path}: line {n} is a JSON {type(row).__name__}, not an object with fields"
                    )
                yield f"line {n}", row
        return
    if suffix == ".parquet":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never a download
        from datasets import Dataset

        try:
            table = Dataset.from_parquet(str(path), keep_in_memory=True)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(
                f"{path}: not a readable Parquet file ({type(e).__name__}: {e})"
            ) from None
        for n, row in enumerate(table, 1):
            yield f"row {n}", row
        return
    raise DataError(
        f"{path}: unknown file type {suffix!r}; use .jsonl (one JSON object per line) or .parquet"
    )


def _text(value: object, where: str, field: str) -> str:
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: field {field!r} is {value!r}, not text")
    if isinstance(value, (int, float)):
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {field!r} must be non-empty text, got {value!r:.60}")
    return value


def _messages(value: object, where: str, field: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(
            f"{where}: field {field!r} must be a non-empty list of {{role, content}} messages"
        )
    out = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: field {field!r}, message {i}: expected {{'role': str, 'content': str}}, "
                f"got {m!r:.80}"
            )
        out.append((m["role"], m["content"]))
    if out[-1][0] != "user":
        raise DataError(
            f"{where}: field {field!r}: the last message must be the user's (the model answers it), "
            f"got role {out[-1][0]!r}"
        )
    return tuple(out)


@dataclass(frozen=True)
class RowFormat:
    """How the rows of a dataset file read (``make_splits``' options of the same names): which fields hold
    the prompt or messages, the answer and the domain, and what each example gets (system prompt, verifier,
    answer regex). Checked when made: a bad verifier or answer regex is refused before any file is read."""

    prompt_field: str = "prompt"
    messages_field: str = ""
    answer_field: str = "answer"
    domain_field: str = ""
    system: str = ""
    verifier: str = "numeric"
    domain_verifiers: Mapping[str, str] | None = None
    answer_regex: str = ""

    def __post_init__(self) -> None:
        if self.prompt_field and self.messages_field and self.prompt_field != "prompt":
            raise DataError("task.options: give prompt_field or messages_field, not both")
        for v in [self.verifier, *(self.domain_verifiers or {}).values()]:
            check_verifier(v)
        if self.answer_regex:
            _check_answer_regex(self.answer_regex)

    def example(self, row: Mapping[str, object], where: str, source: str) -> FileExample:
        """One row as a ``FileExample``; DataError naming ``where`` for a missing or bad field."""
        for field in filter(
            None, (self.messages_field or self.prompt_field, self.answer_field, self.domain_field)
        ):
            if field not in row:
                raise DataError(
                    f"{where}: no field {field!r} (fields: {', '.join(sorted(row)) or 'none'})"
                )
        messages = (
            _messages(row[self.messages_field], where, self.messages_field)
            if self.messages_field
            else ()
        )
        prompt = (
            messages[-1][1] if messages else _text(row[self.prompt_field], where, self.prompt_field)
        )
        domain = (
            _text(row[self.domain_field], where, self.domain_field) if self.domain_field else ""
        )
        return FileExample(
            prompt=prompt,
            answer=_text(row[self.answer_field], where, self.answer_field),
            messages=messages,
            system=self.system,
            domain=domain,
            verifier=(self.domain_verifiers or {}).get(domain, self.verifier),
            answer_regex=self.answer_regex,
            source=source,
        )


def load_examples(path: str | Path, fmt: RowFormat | None = None) -> list[FileExample]:
    """Every row of one file as a ``FileExample`` (rows read as ``fmt`` says, by default ``RowFormat()``);
    DataError for the first bad row, the file or a field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path}: no such dataset file")
    fmt = fmt or RowFormat()
    out = [
        fmt.example(row, f"{path}: {label}", f"{path.name}:{label.split()[-1]}")
        for label, row in _rows(path)
    ]
    if not out:
        raise DataError(f"{path}: no rows (an empty dataset file)")
    return out


def make_splits(
    seed: int,
    n_train: int,
    n_heldout: int,
    *,
    train: str = "",
    heldout: str = "",
    heldout_fraction: float = 0.1,
    **row_format: str | Mapping[str, str] | None,
) -> tuple[list[FileExample], list[FileExample]]:
    """(train, held-out) examples from the files: at most ``n_train`` / ``n_heldout`` of each (0: all),
    in a seed-fixed order. Without a held-out file, ``heldout_fraction`` of the shuffled rows (at least one).
    ``row_format``: ``RowFormat``'s fields (how the rows read)."""
    if not train:
        raise DataError(
            "task.options.train: the training file is required (a .jsonl or .parquet path)"
        )
    fmt = RowFormat(**row_format)
    rows = load_examples(train, fmt)
    random.Random(seed).shuffle(rows)
    if heldout:
        held = load_examples(heldout, fmt)
        random.Random(seed + 1).shuffle(held)
    else:
        held, rows = _hold_out(rows, heldout_fraction, train)
    return rows[: n_train or None], held[: n_heldout or None]


def _check_answer_regex(answer_regex: str) -> None:
    """DataError unless ``answer_regex`` compiles with a group (the answer is group 1)."""
    try:
        groups = re.compile(answer_regex).groups
    except re.error as e:
        raise DataError(
            f"task.options.answer_regex {answer_regex!r} is not a regular expression: {e}"
        ) from None
    if groups < 1:
        raise DataError(
            f"task.options.answer_regex {answer_regex!r} needs a group: the answer is group 1"
        )


def _hold_out(
    rows: list[FileExample], heldout_fraction: float, train: str
) -> tuple[list[FileExample], list[FileExample]]:
    """(held-out, train) of the shuffled ``rows``: ``heldout_fraction`` of them (at least one)."""
    if not 0 < heldout_fraction < 1:
        raise DataError(
            f"task.options.heldout_fraction must be in (0, 1) without a heldout file, "
            f"got {heldout_fraction}"
        )
    cut = max(1, round(len(rows) * heldout_fraction))
    if cut >= len(rows):
        raise DataError(
            f"{train}: {len(rows)} row(s) leave nothing to train on after holding out {cut}"
        )
    return rows[:cut], rows[cut:]


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Called when the config is loaded (``TaskConfig``): the file paths made absolute (the ranks may run
    elsewhere than the launching shell's directory) and every row read once, so a bad file fails before any
    rank starts. Returns the options to keep."""
    known = {"train", "heldout", "heldout_fraction"} | {
        f.name for f in dataclasses.fields(RowFormat)
    }
    unknown = sorted(set(options) - known)
    if unknown:
        raise DataError(
            f"task.options: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}"
        )
    for key in ("train", "heldout"):
        if options.get(key):
            options[key] = str(Path(options[key]).expanduser().absolute())
    # files that are not here (a config for the cluster, planned on a laptop) are for `train` and `submit` to
    # refuse (config.missing_inputs) and for `plan` to warn about; those that are here are read now
    if all(Path(options[k]).is_file() for k in ("train", "heldout") if options.get(k)):
        make_splits(0, 0, 0, **options)
    return options


def data_paths(options: dict[str, Any]) -> list[tuple[str, str]]:
    """(option key, path) of every dataset file the options name."""
    return [(key, options[key]) for key in ("train", "heldout") if options.get(key)]


# ---------------------------------------------------------------- scoring
def check_verifier(name: str) -> Callable[[str, str], float] | None:
    """The custom verifier function for an import path (None for a built-in one); ValueError otherwise."""
    if name in VERIFIERS:
        return None
    module, _, attr = name.partition(":")
    if not attr:
        raise DataError(
            f"verifier {name!r}: use one of {', '.join(VERIFIERS)} or package.module:function"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise DataError(f"verifier {name!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise DataError(f"verifier {name!r} is not a function")
    return fn


def extract(example: FileExample, response_text: str) -> str | None:
    """The answer part of a response: group 1 of the last ``answer_regex`` match, else the whole text."""
    if not example.answer_regex:
        return response_text
    found = list(re.finditer(example.answer_regex, response_text))
    return found[-1].group(1) if found else None


def _number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def score(example: FileExample, response_text: str) -> float:
    """The row's verifier on the response's answer: 1.0 / 0.0 for the built-in ones."""
    answer = extract(example, response_text)
    if answer is None:
        return 0.0
    if example.verifier == "exact":
        return float(answer.strip() == example.answer.strip())
    if example.verifier == "numeric":
        got, want = _number(answer), _number(example.answer)
        return float(
            got is not None
            and want is not None
            and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        )
    if example.verifier == "math":
        return score_answer(answer, example.answer)
    fn = check_verifier(example.verifier)
    return float(fn(answer, example.answer))
