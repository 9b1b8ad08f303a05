"""Decode threads: one-token forwards on `decode_threads`, then torch's threads back as they were; every other
forward (prefill, recompute, verify) on them as they are. By default every session decodes on every thread: the TUI's
engine, headless runs, scripts and notebooks."""

import pytest
import torch

from kvtui.engine.chat.configure import session_config
from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.options import AppConfig, build_session_config


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def forwards(tiny_model):
    """The tiny llama, and the (tokens fed, torch threads) of each of its forwards, read inside the forward."""
    model, tokenizer = tiny_model("llama")
    seen: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["input_ids"].shape[1], torch.get_num_threads())), with_kwargs=True
    )
    yield model, tokenizer, seen
    hook.remove()


def test_decode_runs_on_its_own_threads_and_everything_else_on_all(forwards, two_threads):
    model, tokenizer, seen = forwards
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=4, decode_threads=1))
    session.send("hello there")
    session.generate()
    prefill, decode = seen[0], seen[1:]
    assert prefill[0] > 1 and prefill[1] == 2
    assert decode and all(tokens == 1 and threads == 1 for tokens, threads in decode)
    assert torch.get_num_threads() == 2  # the process's threads are as they were between forwards
    session.rewind(2)  # a full layer crops: no forward
    seen.clear()
    result = session.verify()  # the full recompute: every token in one forward
    assert result.ok and seen == [(len(session.buffer), 2)]


def test_without_decode_threads_forwards_run_on_torchs_threads_as_they_are(forwards, two_threads):
    model, tokenizer, seen = forwards
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=3))
    session.send("hello there")
    session.generate()
    torch.set_num_threads(1)  # the embedding program changes them: the next prefill runs on what it set
    session.send("and again")
    threads = [t for _, t in seen]
    assert len(threads) > 2 and set(threads[:-1]) == {2} and threads[-1] == 1


def test_a_prefill_follows_the_programs_threads(forwards, two_threads):
    model, tokenizer, seen = forwards
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=3, decode_threads=1))
    session.send("hello there")
    session.generate()
    torch.set_num_threads(3)  # the embedding program changes them between turns
    seen.clear()
    session.send("and again")
    session.generate()
    assert seen[0][0] > 1 and seen[0][1] == 3
    assert all(threads == 1 for _, threads in seen[1:]) and torch.get_num_threads() == 3


def test_sessions_decode_on_every_thread_unless_told(two_threads):
    assert build_session_config({}).decode_threads is None  # torch's threads as they are
    assert build_session_config({"threads": 2}).decode_threads is None  # --threads: every forward on 2
    assert build_session_config({"decode_threads": 1}).decode_threads == 1  # as told
    options = AppConfig(options={}).options  # what the TUI hands its engine process (configure.session_config)
    assert session_config(options).decode_threads is None


def test_a_headless_session_decodes_on_every_thread(forwards, two_threads):
    model, tokenizer, seen = forwards  # the session `kvtui --headless` builds
    session = ChatSession(model, tokenizer, build_session_config({"max_new_tokens": 4}, tokenizer))
    session.send("hello there")
    session.generate()
    assert len(seen) > 2 and all(threads == 2 for _, threads in seen)
