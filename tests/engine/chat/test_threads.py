"""Decode threads: one-token forwards on `decode_threads`, then torch's threads back as they were; every other
forward (prefill, recompute, verify) on them as they are. By default only the TUI's engine decodes on one thread
fewer (a core left to its panes); headless runs, scripts and notebooks decode on every thread."""

import pytest
import torch

from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.engine.chat.configure import session_config
from kvtui.options import DEFAULT_OPTIONS, build_session_config


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


def test_only_a_viewers_session_keeps_a_core_unless_told(two_threads):
    assert build_session_config({}).decode_threads is None  # headless, scripts: every thread
    assert session_config({**DEFAULT_OPTIONS}, viewer=True).decode_threads == 1  # the TUI's engine
    assert session_config({**DEFAULT_OPTIONS, "threads": 2}, viewer=True).decode_threads is None  # --threads: all on 2
    assert session_config({**DEFAULT_OPTIONS, "decode_threads": 2}, viewer=True).decode_threads == 2
    assert build_session_config({"decode_threads": 1}).decode_threads == 1  # headless told: as told
    torch.set_num_threads(1)
    assert session_config({**DEFAULT_OPTIONS}, viewer=True).decode_threads == 1  # never 0


def test_a_headless_session_decodes_on_every_thread(forwards, two_threads):
    model, tokenizer, seen = forwards
    session = ChatSession(model, tokenizer, build_session_config({"max_new_tokens": 4}, tokenizer))
    session.send("hello there")
    session.generate()
    assert len(seen) > 2 and all(threads == 2 for _, threads in seen)
