"""`--press SPEC` where kvpress may be absent (the newest transformers: kvpress pins <5.3): the grammar, a bad spec
as a click error, and a missing kvpress as one line naming how to install it, from the CLI and from the engine.
What a press does to the chat is tested with kvpress itself in tests/kvpress/test_chat_press.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtui.compare import CompareError, lane_options, parse_strategies, trace_name
from kvtui.engine.chat.press_spec import PressSpec, PressSpecError, kvpress_installed, parse_press

NO_KVPRESS = not kvpress_installed()  # (tests/kvpress on the test path is a folder, not kvpress)


def _kvtui(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvtui.cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_grammar():
    assert parse_press("knorm:0.5") == PressSpec("knorm", ratio=0.5)
    assert parse_press("SnapKV:0.25").text == "snapkv:0.25"
    assert parse_press("streaming:4+64") == PressSpec("streaming", sinks=4, window=64)
    assert parse_press("streaming:0+8").describe() == "StreamingLLMPress(n_sink=0, keeps 0 + 8)"
    assert parse_press("expected:0.3").press_class == "ExpectedAttentionPress"
    for bad, says in [
        ("knorm", "unknown press"),
        ("zip:0.5", "unknown press"),
        ("knorm:1", "0 < RATIO < 1"),
        ("knorm:0", "0 < RATIO < 1"),
        ("knorm:half", "takes a RATIO"),
        ("streaming:4", "SINKS+WINDOW"),
        ("streaming:4+0", "at least 1"),
    ]:
        with pytest.raises(PressSpecError, match=says.replace("+", r"\+")):
            parse_press(bad)


def test_compare_takes_a_press_lane():
    assert parse_strategies("dynamic, press:KNORM:0.5") == ("dynamic", "press:knorm:0.5")
    options = lane_options("press:streaming:4+64", {})
    assert options["cache"] == "dynamic" and options["press"] == "streaming:4+64"
    assert lane_options("dynamic", {})["press"] is None
    assert trace_name("press:streaming:4+64") == "compare-press-streaming-4-64.jsonl"
    with pytest.raises(CompareError, match="0 < RATIO < 1"):
        parse_strategies("dynamic,press:knorm:3")


def test_a_bad_spec_is_a_click_error():
    run = _kvtui("tiny:llama", "--headless", "--script", "nowhere.txt", "--press", "knorm:2")
    assert run.returncode == 2
    assert "Invalid value for '--press'" in run.stderr and "0 < RATIO < 1" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.skipif(not NO_KVPRESS, reason="kvpress is installed here: tests/kvpress covers the press itself")
def test_without_kvpress_the_cli_says_how_to_install_it(tmp_path):
    script = tmp_path / "chat.txt"
    script.write_text("hello\n")
    run = _kvtui("tiny:llama", "--headless", "--script", script, "--press", "knorm:0.5")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "pip install kvpress==0.5.5" in run.stderr and "<5.3" in run.stderr
    assert "Traceback" not in run.stderr
    run = _kvtui("compare", "tiny:llama", "--caches", "dynamic,press:knorm:0.5", "--script", script, "--headless")
    assert run.returncode == 2 and "pip install kvpress==0.5.5" in run.stderr


@pytest.mark.skipif(not NO_KVPRESS, reason="kvpress is installed here: tests/kvpress covers the press itself")
def test_without_kvpress_the_session_refuses_in_one_line(tiny_model):
    from kvtui.engine.chat.session import ChatSession, SessionConfig, SessionError

    model, tokenizer = tiny_model("llama")
    with pytest.raises(SessionError, match=r"--press needs kvpress.*pip install kvpress==0\.5\.5"):
        ChatSession(model, tokenizer, SessionConfig(press="knorm:0.5"))
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=2))  # nothing else changed
    session.send("hello")
    assert session.press is None and session.held is None
