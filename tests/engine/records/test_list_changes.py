"""The engine sends the chat and the alarms as what changed (engine/records/stream.py ListChanges -> ListCopy): the
viewer's copy is the sender's list after every record, and a record's size follows the change, not the
list's length."""

import json
import random

from kvtui.engine.records.stream import ListChanges, ListCopy


def test_the_copy_follows_every_edit_of_a_growing_chat():
    rng = random.Random(7)
    sender, viewer = ListChanges(), ListCopy()
    chat: list[dict] = []
    for _ in range(500):
        edit = rng.choice(["append", "grow last", "grow last", "rewind", "same", "replace"])
        if edit == "append" or not chat:
            chat.append({"role": rng.choice(["user", "assistant"]), "content": "x" * rng.randint(0, 40)})
        elif edit == "grow last":
            chat[-1]["content"] += "more"  # mutated in place, as a reply being decoded is
        elif edit == "rewind":
            del chat[rng.randint(0, len(chat) - 1) :]
        elif edit == "replace":
            chat[rng.randint(0, len(chat) - 1)] = {"role": "user", "content": str(rng.random())}
        record = json.loads(json.dumps(_put(sender, chat, always=rng.random() < 0.2)))  # through the pipe
        viewer.update(record, "messages")
        assert viewer.items == chat


def _put(sender, chat, always):
    record = {"type": "state"}
    sender.put(record, "messages", chat, always=always)
    return record


def test_a_record_carries_the_change_not_the_chat():
    sender = ListChanges()
    chat = [{"role": "user", "content": "a long question " * 200}, {"role": "assistant", "content": ""}]
    first = _put(sender, chat, always=True)
    assert first["messages_from"] == 0 and len(first["messages"]) == 2
    chat[-1]["content"] += "Hello"
    changed = _put(sender, chat, always=False)
    assert changed["messages_from"] == 1 and changed["messages"] == [{"role": "assistant", "content": "Hello"}]
    assert "messages" not in _put(sender, chat, always=False)  # nothing changed: nothing sent
    same = _put(sender, chat, always=True)  # a state record says "unchanged" in a few bytes
    assert same["messages_from"] == 2 and same["messages"] == []
    assert len(json.dumps(changed)) < 100 < len(json.dumps(first))
