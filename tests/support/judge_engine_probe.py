"""Runs the judge role with an in-process vLLM engine once for tests/world/test_judge_engine.py; writes JSON.

    python tests/support/judge_engine_probe.py SPEC.json RESULT.json

SPEC names the policy (its tokenizer decodes responses) and the judge model; the test owns every
comparison. vLLM needs a ``__main__`` guard and ~20 s to start, so one process runs all the checks.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str, result_path: str) -> None:
    from transformers import AutoTokenizer

    from rollhpc.config import from_dict
    from rollhpc.parallel import RankCoords
    from rollhpc.rewards.judge import JudgeCounters, judge_outputs
    from rollhpc.tasks import arithmetic
    from rollhpc.protocol.worker import WorkerContext
    from rollhpc.workers.judge import JudgeWorker

    spec = json.loads(Path(spec_path).read_text())
    ctx = WorkerContext(
        role="judge",
        world_rank=1,
        coords=RankCoords(0, 0, 0, 0, 0, 1, True),
        group_size=1,
        role_comm=None,
        run_dir=Path(result_path).parent,
        seed=0,
    )
    options = from_dict(
        JudgeWorker.Options,
        {
            "policy_model_dir": spec["policy_dir"],
            "judge_model_dir": spec["judge_dir"],
            "template": spec["template"],
            "task": "arithmetic",
            "max_tokens": 6,
            "max_model_len": 128,
            "cpu_kv_cache_mb": 32,
            "dtype": "float32",
            "threads": 1,
        },
        "roles.judge.options",
    )
    res: dict = {}
    t = time.perf_counter()
    worker = JudgeWorker(ctx, options)
    res["start_s"] = time.perf_counter() - t

    tok = AutoTokenizer.from_pretrained(spec["policy_dir"])
    examples = arithmetic.make_splits(5, 12, 0, digits=2, ops=("+",))[0]
    responses = [e.answer for e in examples[:4]] + ["", " 17", "3 + 4", " 7 7 7"] * 2
    items = [
        (e, tok(r, add_special_tokens=False)["input_ids"]) for e, r in zip(examples, responses)
    ]
    t = time.perf_counter()
    res["scores"] = worker.score(items)
    res["batch_s"] = time.perf_counter() - t
    res["components"] = worker.score_components(items[:2])
    res["metrics"] = worker.metrics()

    # > max_model_len
    too_long = (
        examples[0],
        tok(" 7" * 200, add_special_tokens=False)["input_ids"],
    )
    res["with_too_long"] = worker.score([too_long, items[0]])
    res["metrics_after_too_long"] = worker.metrics()

    from rollhpc.rewards.judge import render_prompt

    prompts = [
        render_prompt(spec["template"], question=e.prompt, response=r, reference=e.answer)
        for e, r in zip(examples[:3], responses[:3])
    ]
    res["outputs"] = worker.backend.complete(prompts, 6)
    counters = JudgeCounters()
    res["score_mode"] = judge_outputs(res["outputs"], "score", 10, counters)
    res["score_mode_counters"] = counters.as_dict()
    res["off_template"] = worker.backend.complete(["hello"], 6)
    worker.close()
    Path(result_path).write_text(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
