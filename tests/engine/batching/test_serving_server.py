"""`transformers serve --continuous-batching` watched for real: concurrent requests, each named with its tokens and
blocks, no false position-gap, answers identical to the same server unwatched."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SYSTEM = "You are a helpful assistant who answers briefly, politely and always in plain English, in one line."
MESSAGES = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a cache?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Hello there, who are you?"}],
]
# sent after those three finished: its system prompt's whole blocks are found in the prefix cache (a hit, no miss)
LATER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a number."}]


def _serve_available() -> str | None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
    except ImportError as error:
        return f"no continuous batching serve on this transformers ({error})"
    if shutil.which("transformers", path=os.path.dirname(sys.executable)) is None:
        return "no `transformers` command next to this Python"
    return None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(port: int, model: str, messages: list) -> str:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())["choices"][0]["message"]["content"]


def _run(model: str, watched_trace: Path | None) -> list[str]:
    port = _port()
    serve = [
        os.path.join(os.path.dirname(sys.executable), "transformers"),
        "serve",
        "--continuous-batching",
        "--attn-implementation",
        "sdpa",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--cb-block-size",
        "16",
        "--cb-num-blocks",
        "64",
        "--port",
        str(port),
        model,
    ]
    command = (
        serve
        if watched_trace is None
        else [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--trace", str(watched_trace), "--", *serve]
    )
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda m: _ask(port, model, m), MESSAGES))
        return [*answers, _ask(port, model, LATER)]
    finally:
        process.send_signal(signal.SIGTERM)  # the server ignores SIGINT for a while; SIGTERM ends it
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def test_server_requests_are_lanes(tiny_dir, tmp_path):
    reason = _serve_available()
    if reason:
        pytest.skip(reason)
    model = str(tiny_dir("llama"))
    plain = _run(model, None)
    trace = tmp_path / "serve.jsonl"
    watched = _run(model, trace)
    assert watched == plain
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r.get("type") == "step"]
    packed = [s for s in steps if s.get("requests") is not None]
    assert packed
    assert not [d for s in steps for d in s.get("diagnostics", []) if d["code"] == "position-gap"]
    requests = {v["request_id"]: v for s in packed for v in s["requests"]}
    assert len(requests) == 4 and all(v["blocks"] and v["prompt_length"] for v in requests.values())
    assert all(not s["caller"].startswith(("fastapi", "starlette")) for s in packed)
    # the shared system prompt: the concurrent requests share its blocks, the later one found them cached
    assert sum(1 for v in requests.values() if v["shared"] > 0) >= 2
    later = [v for v in requests.values() if v["prefix_hit"] > 0]
    assert len(later) == 1 and later[0]["prefix_hit"] % 16 == 0 and later[0]["recomputed"] == 0
    assert not [d for s in steps for d in s.get("diagnostics", [])]  # a real server's hits and shares: no alarm


def test_a_server_without_prefix_sharing_names_the_miss_at_its_token(tiny_dir, tmp_path):
    """A model with sliding-window layers: transformers shares no prefix blocks (full-attention models only), so
    the later request re-encodes the system prompt an earlier one held: one recomputed-prefix, naming the request
    that held it, that it had finished, and the token where the prompts part (computed here with the tokenizer)."""
    reason = _serve_available()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    model = str(tiny_dir("mistral", sliding_window=32))
    plain = _run(model, None)
    trace = tmp_path / "serve.jsonl"
    watched = _run(model, trace)
    assert watched == plain
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r.get("type") == "step"]
    alarms = [d for s in steps for d in s.get("diagnostics", [])]
    assert [d["code"] for d in alarms] == ["recomputed-prefix"], alarms
    tokenizer = AutoTokenizer.from_pretrained(model)

    def ids(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])

    later = ids(LATER)
    shared = max(range(len(MESSAGES)), key=lambda i: _common(ids(MESSAGES[i]), later))
    common = _common(ids(MESSAGES[shared]), later)
    token = later[common]
    message = alarms[0]["message"]
    assert f"re-encoded {common} tokens that request" in message and "held (it has finished)" in message
    assert f"at token {common} ({tokenizer.decode([token])!r} (id {token}))" in message
    assert "prefix sharing is off" in message
    requests = {v["request_id"]: v for s in steps for v in s.get("requests") or []}
    assert sorted(v["recomputed"] for v in requests.values()) == [0, 0, 0, common]


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
