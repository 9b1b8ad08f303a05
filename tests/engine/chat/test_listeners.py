"""A session's callbacks take several subscribers: a second one never silently replaces the first."""

from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.engine.records.listeners import Listeners
from kvtui.engine.records.recorder import Recorder
from kvtui.engine.records.trace import read_trace


def test_two_subscribers_both_receive_every_snapshot_and_event(tiny_model, tmp_path):
    model, tok = tiny_model("qwen2")
    first: list = []
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=3), on_snapshot=first.append)
    second: list = []
    session.on_snapshot.add(second.append)
    trace = tmp_path / "chat.jsonl"
    recorder = Recorder(session, trace)  # subscribes to on_event
    events: list = []
    session.on_event.add(lambda kind, payload: events.append(kind))

    session.send("What is k?")
    session.generate()
    session.rewind(1)
    recorder.close()

    assert first and [s.step for s in first] == [s.step for s in second]
    assert events.count("step") == len(first)
    assert "rewind" in events
    written = read_trace(trace)
    assert [s["step"] for s in written.steps] == [s.step for s in first]  # the recorder still wrote every step
    assert [e["type"] for e in written.events] == ["rewind"]


def test_listeners_call_in_order_and_remove():
    calls: list = []
    listeners: Listeners = Listeners()
    a = listeners.add(lambda x: calls.append(("a", x)))
    listeners.add(lambda x: calls.append(("b", x)))
    listeners.add(lambda x: calls.append(("first", x)), first=True)
    listeners(1)
    listeners.remove(a)
    listeners.remove(a)  # not subscribed any more: ignored
    listeners(2)
    assert calls == [("first", 1), ("a", 1), ("b", 1), ("first", 2), ("b", 2)]
    assert len(listeners) == 2
