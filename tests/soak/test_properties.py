"""Property tests: incremental template diffing never feeds silently; the trace reader fails only as TraceError."""

from __future__ import annotations

import io
import json
import re

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from rich.console import Console

from kvtui.engine.chat.script import Script
from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.engine.records.replay import Replay
from kvtui.engine.records.trace import Trace, TraceError, read_trace
from kvtui.headless import run_script

SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)

# Words the tiny tokenizer was trained on (kvtui.engine.models.tiny.CORPUS), so texts tokenize into a few ids each.
WORDS = (
    "k",
    "variable",
    "equal",
    "to",
    "5",
    "cat",
    "sun",
    "window",
    "cache",
    "token",
    "key",
    "value",
    "the",
    "attention",
    "layer",
    "sky",
    "blue",
    "Paris",
    "France",
    "hello",
    "story",
    "quick",
    "fox",
    "dog",
    "42",
    "What",
    "is",
    "multiplied",
    "by",
    "3",
    "?",
    "!",
    ".",
    ",",
    "please",
    "answer",
)
TEMPLATES = ("qwen2", "counter")  # the family template, and one that re-renders the first turn every time


@pytest.fixture(scope="module")
def torch_one_thread_module():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see conftest.one_torch_thread: tiny forwards on 2 busy cores
    yield
    torch.set_num_threads(before)


# ---- a. incremental template diff ----------------------------------------------------------------


sentences = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers 5.x returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)


def first_difference(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


@st.composite
def edits(draw, content: str) -> str:
    """A random edit of a message's content (sometimes none at all)."""
    words = content.split(" ") if content else []
    kind = draw(st.sampled_from(["none", "replace", "insert", "delete", "append", "upper", "space"]))
    at = draw(st.integers(0, max(0, len(words) - 1)))
    word = draw(st.sampled_from(WORDS))
    if kind == "replace" and words:
        words[at] = word
    elif kind == "insert":
        words.insert(at, word)
    elif kind == "delete" and words:
        del words[at]
    elif kind == "append":
        words.append(word)
    elif kind == "upper" and words:
        words[at] = words[at].upper()
    elif kind == "space":
        return content + " "
    return " ".join(words)


@SETTINGS
@given(data=st.data())
def test_an_edited_earlier_turn_is_reported_as_drift_at_the_first_differing_index(
    tiny_model, torch_one_thread_module, data
):
    template = data.draw(st.sampled_from(TEMPLATES), label="template")
    model, tokenizer = tiny_model("qwen2") if template == "qwen2" else tiny_model("qwen2", template=template)
    system = data.draw(st.none() | sentences, label="system")
    turns = data.draw(st.lists(sentences, min_size=2, max_size=4), label="turns")
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=3, system=system))
    for number, text in enumerate(turns):
        if number and data.draw(st.booleans(), label=f"edit before turn {number}"):
            # an earlier message as the template will see it; never the reply still open at the end,
            # which send() re-reads from the cache (that is what the cache holds, not an edit)
            index = data.draw(st.integers(0, len(session._messages) - 2), label="message")
            message = session._messages[index]
            message.content = data.draw(edits(message.content), label=f"{message.role} content")
        cached = session.buffer.ids()
        expected = template_ids(tokenizer, session.messages + [{"role": "user", "content": text}])
        differs_at = first_difference(cached, expected)
        before = len(session.diagnostics)

        snapshot = session.send(text)

        drifts = [d for d in session.diagnostics[before:] if d.code == "template-drift"]
        assert session.buffer.ids() == expected  # never silently fed: the cache is the template's rendering
        if differs_at < len(cached):
            event("drift")
            assert len(drifts) == 1, drifts
            assert f"at index {differs_at} " in drifts[0].message, (differs_at, drifts[0].message)
            assert drifts[0] in snapshot.diagnostics
        else:
            event("no drift" if number else "first turn")
            assert drifts == []
        # only what the cache lacked was fed (the last token again when nothing is new, for fresh logits)
        start = min(differs_at, len(expected) - 1)
        assert list(snapshot.input_ids) == expected[start:]
        note(f"turn {number}: cached {len(cached)}, rendered {len(expected)}, first difference {differs_at}")
        session.generate()


# ---- b. the trace reader on corrupted input --------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace(tiny_model, tmp_path_factory, torch_one_thread_module) -> bytes:
    """A real headless recording (2 turns, a verify, non-ASCII text) as bytes."""
    model, tokenizer = tiny_model("qwen2")
    path = tmp_path_factory.mktemp("trace") / "small.jsonl"
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=4))
    code = run_script(
        session,
        Script(turns=("What is k? café → ok", "And the cat?")),
        trace_path=path,
        model_source="tiny-qwen2",
        model_path="tiny",
        verify_every=3,
        console=Console(file=io.StringIO()),
    )
    assert code == 0
    data = path.read_bytes()
    assert data.endswith(b"\n") and read_trace(path).steps
    return data


def lines_of(data: bytes) -> list[bytes]:
    return data.split(b"\n")


@st.composite
def corruption(draw, data: bytes):
    """Apply 1-3 random corruptions to the trace's bytes."""
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                ["truncate", "flip", "replace", "delete-line", "duplicate-line", "garbage-line", "swap-lines"]
            )
        )
        lines = lines_of(data)
        if kind == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif kind in ("flip", "replace") and data:
            at = draw(st.integers(0, len(data) - 1))
            byte = data[at] ^ (1 << draw(st.integers(0, 7))) if kind == "flip" else draw(st.integers(0, 255))
            data = data[:at] + bytes([byte]) + data[at + 1 :]
        elif kind == "delete-line" and len(lines) > 1:
            del lines[draw(st.integers(0, len(lines) - 1))]
            data = b"\n".join(lines)
        elif kind == "duplicate-line":
            at = draw(st.integers(0, len(lines) - 1))
            lines.insert(at, lines[at])
            data = b"\n".join(lines)
        elif kind == "garbage-line":
            garbage = draw(
                st.binary(max_size=40)
                | st.text(max_size=40).map(lambda t: t.encode("utf-8"))
                | st.sampled_from(
                    [
                        b"{}",
                        b"[]",
                        b"null",
                        b'{"type": 1}',
                        b'{"type": "step"}',
                        b'"x"',
                        b'{"type": "buffer", "tokens": 3}',
                        b"1" * 5000,
                        b"[" * 5000,
                    ]
                )
            )
            lines.insert(draw(st.integers(0, len(lines))), garbage)
            data = b"\n".join(lines)
        elif kind == "swap-lines" and len(lines) > 1:
            a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[a], lines[b] = lines[b], lines[a]
            data = b"\n".join(lines)
        note(f"{kind}: {len(data)} bytes")
    return data


def check_error(exc: TraceError, path, data: bytes) -> None:
    message = str(exc)
    assert message.startswith(f"{path}:"), message
    found = re.match(rf"{re.escape(str(path))}:(\d+): ", message)
    if found:
        assert 1 <= int(found.group(1)) <= len(lines_of(data)), message
    else:  # the only messages not about one line
        assert message == f"{path}: empty trace (no header)", message


@SETTINGS
@given(data=st.data())
def test_a_corrupted_trace_reads_back_or_raises_trace_error_naming_file_and_line(small_trace, tmp_path_factory, data):
    corrupted = data.draw(corruption(small_trace), label="corrupted")
    path = tmp_path_factory.getbasetemp() / "corrupt.jsonl"
    path.write_bytes(corrupted)
    try:
        trace = read_trace(path)
    except TraceError as exc:
        event("TraceError")
        check_error(exc, path, corrupted)
        return
    event("read back" + (" (truncated tail)" if trace.truncated else ""))
    assert isinstance(trace, Trace) and isinstance(trace.header, dict)
    if trace.truncated:
        assert not corrupted.endswith(b"\n")
    for step in trace.steps:
        assert {"step", "input_ids", "positions", "cursor", "cache_seq_length", "layers", "topk"} <= step.keys()


@SETTINGS
@given(cut=st.integers(0, 10**9))
def test_a_trace_cut_at_any_byte_keeps_every_finished_line(small_trace, tmp_path_factory, cut):
    cut %= len(small_trace) + 1
    prefix = small_trace[:cut]
    path = tmp_path_factory.getbasetemp() / "cut.jsonl"
    path.write_bytes(prefix)
    lines = lines_of(prefix)
    finished, tail = lines[:-1], lines[-1]
    try:
        tail_record = json.loads(tail.decode("utf-8")) if tail.strip() else None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        tail_record = None
    tail_parses = tail_record is not None
    if not finished and not tail_parses:  # the cut is inside the header (or the file is empty)
        with pytest.raises(TraceError) as raised:
            read_trace(path)
        check_error(raised.value, path, prefix)
        return
    trace = read_trace(path)
    whole = [json.loads(line) for line in finished if line.strip()]
    assert trace.truncated == (bool(tail.strip()) and not tail_parses)
    kept = whole + ([tail_record] if tail_parses else [])
    assert trace.steps == [r for r in kept if r["type"] == "step"]
    assert trace.buffers == [r for r in kept if r["type"] == "buffer"]
    if trace.steps:
        replay = Replay(trace)
        assert len(replay.snapshots[-1].buffer) == trace.steps[-1]["buffer_length"]
