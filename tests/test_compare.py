"""`kvtui compare`: bad input is one line and exit 2 before any engine starts; a headless run on a tiny model
prints one row per strategy, writes one trace each, and says whether the tokens were identical."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

KVTUI = [sys.executable, "-m", "kvtui.cli"]


def _run(args, cwd, env=None, timeout=600):
    return subprocess.run(
        [*KVTUI, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "chat.txt"
    path.write_text("Let's start by defining a variable k equal to 5. What is k?\nNow multiply k by 3. What is k?\n")
    return path


@pytest.mark.parametrize(
    "caches,message",
    [
        ("none,dynamic,paged", "unknown cache strategy 'paged' in --caches"),
        ("dynamic,dynamic", "names a strategy twice"),
        (",", "needs at least one strategy"),
    ],
)
def test_bad_strategies_are_one_line_and_exit_2(tmp_path, script, caches, message):
    out = _run(
        ["compare", "--caches", caches, "--script", script, "--headless", "--trace-dir", tmp_path / "t"], tmp_path
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "t").exists()  # no engine started, nothing written


def test_a_model_that_does_not_fit_is_refused_before_loading(tmp_path, script, tiny_dir):
    model = tiny_dir("llama")
    started = time.perf_counter()
    out = _run(
        [
            "compare",
            model,
            "--caches",
            "none,dynamic,static",
            "--script",
            script,
            "--headless",
            "--memory",
            "0.5",
            "--trace-dir",
            tmp_path / "t",
        ],
        tmp_path,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert re.search(r"3 engines need about [\d.]+ GiB .* only 0\.5 GiB is available", out.stderr)
    assert not (tmp_path / "t").exists() and time.perf_counter() - started < 30


def test_static_compile_without_a_compiler_is_refused(tmp_path, script, tiny_dir):
    bare = tmp_path / "bin"  # a PATH with nothing on it: no g++ / clang++ (python is named by its full path)
    bare.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PATH"] = str(bare)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtui.cli",
            "compare",
            str(tiny_dir("llama")),
            "--caches",
            "dynamic,static+compile",
            "--script",
            str(script),
            "--headless",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "static+compile cannot run here: torch.compile on CPU needs a C++ compiler" in out.stderr


def test_headless_compare_on_a_tiny_model(tmp_path, script, tiny_dir, tiny_model):
    import torch

    from kvtui.engine import ChatSession, SessionConfig
    from kvtui.fmt import size

    model_dir = tiny_dir("llama")
    out = _run(
        [
            "compare",
            model_dir,
            "--caches",
            "none,dynamic,static",
            "--script",
            script,
            "--headless",
            "--max-new-tokens",
            "6",
            "--max-cache-len",
            "256",
            "--threads",
            "1",
            "--trace-dir",
            tmp_path / "t",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "tokens identical: yes"
    rows = {
        line.split()[0]: line for line in lines if line.split() and line.split()[0] in ("none", "dynamic", "static")
    }
    assert set(rows) == {"none", "dynamic", "static"}
    traces = {
        s: [json.loads(line) for line in (tmp_path / "t" / f"compare-{s}.jsonl").read_text().splitlines()] for s in rows
    }
    # the same chat, computed here without kvtui's engines: the dynamic session's tokens are every trace's tokens
    model, tokenizer = tiny_model("llama")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engines ran: a reduction over other threads may round differently
    try:
        session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=6))
        for turn in script.read_text().splitlines():
            session.send(turn)
            session.generate()
    finally:
        torch.set_num_threads(threads)
    for strategy, records in traces.items():
        buffer = [r for r in records if r["type"] == "buffer"][-1]
        assert [t["id"] for t in buffer["tokens"]] == session.buffer.ids(), strategy
        steps = [r for r in records if r["type"] == "step"]
        assert all(r.get("uncached") for r in steps) == (strategy == "none")
    # cache bytes: the dynamic cache's K and V, [1, kv_heads, T, head_dim] fp32 per layer; the static one is
    # preallocated
    kv_heads, head_dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    layers, held = model.config.num_hidden_layers, session.cache_length
    assert size(layers * 2 * kv_heads * held * head_dim * 4) in rows["dynamic"]
    assert size(layers * 2 * kv_heads * 256 * head_dim * 4) in rows["static"]
    assert "0 (no cache)" in rows["none"]
    # ms per token at the start and at the end of the context, at the context lengths the traces hold
    decode = [r for r in traces["none"] if r["type"] == "step" and r["phase"] == "decode"]
    assert f"@{decode[-1]['buffer_length']}" in rows["none"] and f"@{decode[0]['buffer_length']}" in rows["none"]


def test_a_lane_a_step_ahead_in_the_round_is_not_a_difference():
    from kvtui.compare import Comparison, Lane

    comparison = Comparison.__new__(Comparison)
    comparison.lanes = [Lane("none", chosen=[5, 7, 9]), Lane("dynamic", chosen=[5, 7])]
    assert comparison.first_difference(final=False) is None  # mid-round: dynamic has not made step 3 yet
    assert comparison.first_difference(final=True) == 3  # at the end, a missing step is a difference
    comparison.lanes[1].chosen.append(8)
    assert comparison.first_difference(final=False) == 3 and not comparison.identical
