"""Judge role: a language model grades each response; its strict verdict is the reward.

For answers no rule can check (proofs, explanations, open questions). The judge is a model of its own,
never the policy: it gets no weight sync, and its verdict is read strictly (``rollhpc.rewards.judge_parse``)
so the policy cannot win by making the judge ramble. It runs in one of two places:

- in this rank (``judge_model_dir``): a vLLM engine built like the generate role's (``EngineConfig``),
  the judge's own tokenizer rendering the prompt (its chat template if it has one) and greedy decoding
  of the whole batch in one engine call; on Slurm the role gets its own devices, so its own het component;
- behind an OpenAI-compatible server (``endpoint``), through ``rollhpc.rewards.judge_http`` with bounded
  timeouts and retries: a shared judge server, or a model too large to colocate.

``score`` keeps the reward role's contract (one float per ``(example, response ids)``); ``score_components``
returns ``{"judge": x}`` per item; ``metrics`` gives the counters (items judged, unparsed verdicts,
failures), which a run should log: a judge that stops following its format shows up as unparsed, not as
a policy that got worse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollhpc.engines.config import EngineConfig
from rollhpc.protocol.worker import Dispatch, Worker, WorkerContext, register
from rollhpc.rewards.components import Components
from rollhpc.rewards.judge import (
    DEFAULT_TEMPLATES,
    JudgeBackend,
    JudgeCounters,
    check_template,
    judge_fields,
    judge_outputs,
    render_prompt,
)
from rollhpc.rewards.judge_http import HttpJudge
from rollhpc.rewards.judge_parse import JudgeMode
from rollhpc.tasks import task_module

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["EngineJudge", "JudgeWorker", "encode_judge_prompt"]

log = logging.getLogger(__name__)


class JudgeWorker(Worker):
    @dataclass(kw_only=True)
    class Options(EngineConfig):  # engine fields apply to the in-process judge only
        policy_model_dir: str  # the policy's tokenizer: decodes the responses being judged
        # in-process judge: its HF directory (weights and tokenizer)
        judge_model_dir: str | None = None
        endpoint: str | None = None  # or: an OpenAI-compatible server's base URL (http://host:port)
        # the served model's name (None: the first of GET /v1/models)
        endpoint_model: str | None = None
        # endpoint only; "chat": the server's chat template
        api: Literal["completions", "chat"] = "completions"
        # fields {question} {response} {reference} {max_score}; None: the mode's default
        template: str | None = None
        # "yes_no": YES -> 1, NO -> 0; "score": "Score: N" -> N / max_score
        mode: JudgeMode = "yes_no"
        max_score: int = 10
        max_tokens: int = 16  # a verdict is short; a longer output is unparsed anyway
        # task module that formats examples' questions (rollhpc.tasks.task_module)
        task: str | None = None
        timeout_s: float = 30.0  # endpoint: per attempt (connect, each read)
        retries: int = 2  # endpoint: more attempts after a refused connection, timeout or 429/5xx
        concurrency: int = 8  # endpoint: requests in flight

        def __post_init__(self) -> None:
            super().__post_init__()
            if (self.judge_model_dir is None) == (self.endpoint is None):
                raise ValueError(
                    "the judge needs exactly one of judge_model_dir (in-process engine) and endpoint "
                    "(an OpenAI-compatible server)"
                )
            if (
                self.judge_model_dir is not None
                and not (Path(self.judge_model_dir) / "config.json").is_file()
            ):
                raise ValueError(
                    f"judge_model_dir {self.judge_model_dir}: not a Hugging Face model directory "
                    "(no config.json there)"
                )
            if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
                raise ValueError(f"endpoint must be an http(s):// URL, got {self.endpoint!r}")
            if self.template is None:
                self.template = DEFAULT_TEMPLATES[self.mode]
            check_template(self.template)
            if self.max_score < 1 or self.max_tokens < 1:
                raise ValueError(
                    f"need max_score >= 1 and max_tokens >= 1, got {self.max_score}, {self.max_tokens}"
                )
            if self.timeout_s <= 0 or self.retries < 0 or self.concurrency < 1:
                raise ValueError("need timeout_s > 0, retries >= 0, concurrency >= 1")
            if self.task is not None:
                task_module(self.task)

    def __init__(self, ctx: WorkerContext, options: Options):
        super().__init__(ctx, options)
        from transformers import (
            AutoTokenizer,
        )  # heavy: not at the top of a role read at config load

        self.tokenizer = AutoTokenizer.from_pretrained(options.policy_model_dir)
        self.task = task_module(options.task) if options.task else None
        self.counters = JudgeCounters()
        self.backend: JudgeBackend
        if options.judge_model_dir is not None:
            self.backend = EngineJudge(
                options.judge_model_dir, options, seed=ctx.seed + ctx.group_rank
            )
        else:
            self.backend = HttpJudge(
                options.endpoint,
                options.endpoint_model,
                api=options.api,
                timeout_s=options.timeout_s,
                retries=options.retries,
                concurrency=options.concurrency,
            )

    @register(Dispatch.DP_SPLIT)
    def score(self, items: list[tuple[Any, list[int]]]) -> list[float]:
        """``(example, response token ids)`` -> the judge's verdict in [0, 1] per item (0 if unparsed/failed)."""
        return [c["judge"] for c in self.score_components(items)]

    @register(Dispatch.DP_SPLIT)
    def score_components(self, items: list[tuple[Any, list[int]]]) -> list[Components]:
        """``{"judge": verdict}`` per item (the components form of ``score``)."""
        o = self.options
        responses = self.tokenizer.batch_decode([ids for _, ids in items], skip_special_tokens=True)
        prompts = []
        for (example, _), response in zip(items, responses):
            question, reference = judge_fields(example, self.task)
            prompts.append(
                render_prompt(
                    o.template,
                    question=question,
                    response=response,
                    reference=reference,
                    max_score=o.max_score,
                )
            )
        outputs = self.backend.complete(prompts, o.max_tokens)
        return [{"judge": s} for s in judge_outputs(outputs, o.mode, o.max_score, self.counters)]

    @register(Dispatch.ONE_TO_ALL)
    def metrics(self) -> dict[str, int]:
        """This rank's counters since start: judge_calls, judge_unparsed, judge_failures."""
        return self.counters.as_dict()

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


class EngineJudge:
    """The judge model in this process: its tokenizer renders, a ``VllmGenerator`` decodes greedily.

    A prompt that does not leave ``max_tokens`` room within ``max_model_len`` is not sent (vLLM would
    refuse the whole batch): it is a failure (None), as a dead server's would be.
    """

    def __init__(self, model_dir: str, engine_options: EngineConfig, seed: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.tokenizer.eos_token_id
        self.max_model_len = engine_options.max_model_len
        self.engine = engine_options.build_engine(
            model_dir, seed, stop_token_ids=[] if eos is None else [eos]
        )

    def complete(self, prompts: list[str], max_tokens: int) -> list[str | None]:
        encoded = [encode_judge_prompt(self.tokenizer, p) for p in prompts]
        fits = [i for i, ids in enumerate(encoded) if len(ids) + max_tokens <= self.max_model_len]
        if len(fits) < len(prompts):
            log.warning(
                "judge: %d of %d prompts leave no room for %d tokens in max_model_len %d; scored 0",
                len(prompts) - len(fits),
                len(prompts),
                max_tokens,
                self.max_model_len,
            )
        outputs: list[str | None] = [None] * len(prompts)
        if fits:
            completions = self.engine.generate(
                [encoded[i] for i in fits], n=1, temperature=0.0, max_tokens=max_tokens
            )
            texts = self.tokenizer.batch_decode(
                [c[0].token_ids for c in completions], skip_special_tokens=True
            )
            for i, text in zip(fits, texts):
                outputs[i] = text
        return outputs

    def close(self) -> None:
        self.engine = None


def encode_judge_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The judge's input ids: ``prompt`` as the user turn of the judge's chat template, or as plain text
    when its tokenizer has none (a base model continues the template's last line)."""
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]
