"""The judge over HTTP: HttpJudge against small stdlib servers (retries, refusals, timeouts: every call
returns within its bound), then the judge role against vLLM's own OpenAI-compatible server on CPU."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rollhpc.parallel import RankCoords
from rollhpc.protocol.worker import WorkerContext
from rollhpc.rewards.judge_http import HttpJudge
from rollhpc.workers.judge import JudgeWorker
from tests.support.judge_models import TEMPLATE, yes_judge

Reply = tuple[int, dict[str, Any]]


@contextmanager
def fake_server(reply: Callable[[str, dict[str, Any] | None], Reply]) -> Iterator[tuple[str, list]]:
    """An HTTP server on loopback answering ``reply(path, body)``; yields (base URL, requests seen)."""
    seen: list[tuple[str, dict[str, Any] | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: dict[str, Any] | None) -> None:
            seen.append((self.path, body))
            status, payload = reply(self.path, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(None)

        def do_POST(self) -> None:  # noqa: N802
            self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion(text: str) -> Reply:
    return 200, {"choices": [{"index": 0, "text": text}]}


def test_retries_on_503_then_answers():
    answers = iter([(503, {"error": "busy"}), (503, {"error": "busy"}), completion("YES")])
    with fake_server(lambda path, body: next(answers)) as (url, seen):
        judge = HttpJudge(url + "/v1/", "m", retries=2, backoff_s=0.01)
        assert judge.complete(["Q"], max_tokens=4) == ["YES"]
    assert [path for path, _ in seen] == ["/v1/completions"] * 3
    assert seen[0][1] == {"model": "m", "max_tokens": 4, "temperature": 0.0, "prompt": "Q"}


def test_client_errors_are_not_retried_and_broken_replies_are_failures():
    with fake_server(lambda path, body: (400, {"error": "prompt too long"})) as (url, seen):
        assert HttpJudge(url, "m", retries=3, backoff_s=0.01).complete(["Q"], 4) == [None]
    assert len(seen) == 1
    with fake_server(lambda path, body: (200, {"choices": []})) as (url, seen):
        assert HttpJudge(url, "m", retries=3, backoff_s=0.01).complete(["Q"], 4) == [None]
    assert len(seen) == 1


def test_model_discovery_and_chat_api():
    def reply(path: str, body: dict[str, Any] | None) -> Reply:
        if path == "/v1/models":
            return 200, {"data": [{"id": "served-judge"}]}
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "NO"}}]}

    with fake_server(reply) as (url, seen):
        judge = HttpJudge(url, api="chat", concurrency=2)
        assert judge.complete(["a", "b", "c"], 2) == ["NO", "NO", "NO"]
    assert seen[0] == ("/v1/models", None)
    assert sorted(b["messages"][0]["content"] for _, b in seen[1:]) == ["a", "b", "c"]
    assert all(b["model"] == "served-judge" for _, b in seen[1:])


def test_a_closed_port_fails_fast_and_counts_every_item():
    judge = HttpJudge(
        f"http://127.0.0.1:{closed_port()}", "m", timeout_s=1.0, retries=2, backoff_s=0.05
    )
    t = time.perf_counter()
    assert judge.complete(["a", "b", "c"], 4) == [None, None, None]
    assert time.perf_counter() - t < 2.0


def test_a_server_that_never_answers_costs_at_most_the_attempts_timeouts():
    with socket.socket() as hole:  # accepts connections (the kernel does) and never replies
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        judge = HttpJudge(
            f"http://127.0.0.1:{hole.getsockname()[1]}",
            "m",
            timeout_s=0.3,
            retries=1,
            backoff_s=0.05,
        )
        t = time.perf_counter()
        assert judge.complete(["a", "b"], 4) == [None, None]
        elapsed = time.perf_counter() - t
    # 2 attempts x 0.3 s + backoff, in parallel for both prompts
    assert 0.6 <= elapsed < 0.6 + 0.05 + 1.0


def judge_worker(tmp_path: Path, policy_dir: Path, **options: Any) -> JudgeWorker:
    from rollhpc.config import from_dict

    ctx = WorkerContext(
        role="judge",
        world_rank=1,
        coords=RankCoords(0, 0, 0, 0, 0, 1, True),
        group_size=1,
        role_comm=None,
        run_dir=tmp_path,
        seed=0,
    )
    opts = from_dict(
        JudgeWorker.Options, {"policy_model_dir": str(policy_dir), **options}, "roles.judge.options"
    )
    return JudgeWorker(ctx, opts)


def arithmetic_items(
    policy_dir: Path, respond: Callable[[Any], str], n: int
) -> list[tuple[Any, list[int]]]:
    """``n`` 2-digit additions, each with ``respond(example)`` as the policy's response token ids."""
    from transformers import AutoTokenizer

    from rollhpc.tasks import arithmetic

    tok = AutoTokenizer.from_pretrained(policy_dir)
    examples = arithmetic.make_splits(3, n, 0, digits=2, ops=("+",))[0]
    return [(e, tok(respond(e), add_special_tokens=False)["input_ids"]) for e in examples]


def test_judge_role_over_http_decodes_renders_parses_and_counts(tiny_model, tmp_path):
    """The fake judge answers from the prompt it got: YES when the response equals the reference."""

    def reply(path: str, body: dict[str, Any] | None) -> Reply:
        response, reference = body["prompt"].split("A:")[1].split("\nRef:")
        if "ramble" in response:
            return completion("I think YES")
        if "crash" in response:
            return 500, {"error": "boom"}
        return completion("YES" if response.strip() == reference.strip() else "NO")

    responses = iter(
        [
            lambda e: f" {e.answer}",
            lambda e: " 1000",
            lambda e: "ramble",
            lambda e: "crash",
            lambda e: e.answer,
        ]
    )
    items = arithmetic_items(tiny_model, lambda e: next(responses)(e), 5)
    with fake_server(reply) as (url, seen):
        worker = judge_worker(
            tmp_path,
            tiny_model,
            endpoint=url,
            endpoint_model="j",
            retries=1,
            timeout_s=5,
            template="Q: {question}\nA:{response}\nRef: {reference}",
            task="arithmetic",
        )
        assert worker.score(items) == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert worker.score_components(items[:1]) == [{"judge": 1.0}]
        worker.close()
    assert worker.metrics() == {"judge_calls": 6, "judge_unparsed": 1, "judge_failures": 1}
    example = items[0][0]
    assert f"Q: {example.prompt}\nA: {example.answer}\nRef: {example.answer}" in [
        b["prompt"] for _, b in seen
    ]
    assert sum("crash" in b["prompt"] for _, b in seen) == 2  # the 500 was retried once


# vLLM's own OpenAI-compatible server on CPU (one per module: ~25 s to start).


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory) -> Iterator[str]:
    """vLLM's api_server on loopback serving the judge that always says YES (tests/support/judge_models.py)."""
    judge_dir = yes_judge(tmp_path_factory.getbasetemp(), tiny_model)
    port = closed_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(judge_dir),
        "--served-model-name",
        "tiny-judge",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--max-num-seqs",
        "16",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"vLLM server exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up after 240 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine-core process
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_judge_role_against_vllm_openai_server(vllm_server, tiny_model, tmp_path):
    canned = iter([" 42", " 17", "", " 100 + 1"] * 4)
    items = arithmetic_items(tiny_model, lambda e: next(canned), 16)
    worker = judge_worker(
        tmp_path,
        tiny_model,
        endpoint=vllm_server,
        task="arithmetic",
        template=TEMPLATE,
        max_tokens=6,
        timeout_s=20,
        retries=1,
    )
    t = time.perf_counter()
    assert worker.score(items) == [1.0] * 16  # the judge's " YES" (model name found by /v1/models)
    print(f"judged {len(items)} items over HTTP in {time.perf_counter() - t:.2f} s")
    assert worker.metrics() == {"judge_calls": 16, "judge_unparsed": 0, "judge_failures": 0}
    # off its one form: no verdict
    assert worker.backend.complete(["hello"], 6)[0].strip() not in (
        "YES",
        "NO",
    )

    scored = judge_worker(
        tmp_path,
        tiny_model,
        endpoint=vllm_server,
        task="arithmetic",
        template=TEMPLATE,
        mode="score",
        max_tokens=6,
    )
    assert scored.score(items[:4]) == [0.0] * 4  # "YES" is not "Score: N": unparsed, counted
    assert scored.metrics() == {"judge_calls": 4, "judge_unparsed": 4, "judge_failures": 0}

    chat = judge_worker(tmp_path, tiny_model, endpoint=vllm_server, api="chat", retries=3)
    t = time.perf_counter()
    # the tiny tokenizer has no chat template: HTTP 400, not retried
    assert chat.score(items[:3]) == [0.0] * 3
    assert time.perf_counter() - t < 5
    assert chat.metrics() == {"judge_calls": 3, "judge_unparsed": 0, "judge_failures": 3}

    gone = judge_worker(
        tmp_path,
        tiny_model,
        endpoint=f"http://127.0.0.1:{closed_port()}",
        endpoint_model="x",
        timeout_s=2,
        retries=2,
    )
    t = time.perf_counter()
    assert gone.score(items) == [0.0] * len(items)
    # 16 items, 8 at a time: 2 waves of at most 3 attempts x 2 s + backoffs 0.5 + 1 s (refused: no waiting)
    assert time.perf_counter() - t < 2 * (3 * 2 + 0.5 + 1.0)
    assert gone.metrics() == {"judge_calls": 16, "judge_unparsed": 0, "judge_failures": 16}
