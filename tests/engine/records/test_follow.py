"""`kvtui replay --follow`: a trace waited for before it exists, and read again from the top when the program
is run again and rewrites it (truncated in place or replaced), whether or not the rewrite overtook the reader."""

import json
import os
import queue
import threading
import time

from kvtui.engine.records.follow import FOLLOW, REWRITTEN, WAITING, FollowSource
from kvtui.engine.records.trace import TraceError

POLL = 0.01


def lines(run: str, steps: int, header_extra: dict | None = None) -> bytes:
    """A trace's bytes: a header and `steps` step records tagged with `run` (what a reader can tell apart)."""
    records = [{"type": "header", "schema": 1, **(header_extra or {})}]
    records += [{"type": "step", "step": i, "run": run, "input_ids": list(range(i))} for i in range(1, steps + 1)]
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


class Follower:
    """FollowSource.records read in a thread, as the replay viewer reads it (the reader goes idle between
    writes, as it does while a program runs)."""

    def __init__(self, path):
        self.got: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        self.thread.start()

    def _run(self, path):
        try:
            for record in FollowSource(path, poll=POLL).records(stop=self.stop):
                self.got.put(record)
        except TraceError as exc:  # the test sees it as what came next
            self.got.put({"type": "error", "error": str(exc)})

    def __next__(self) -> dict:
        return self.got.get(timeout=10)

    def idle(self) -> None:
        """Wait until the reader has found no new line a few times (it read all there was)."""
        time.sleep(POLL * 10)
        assert self.got.empty()

    def close(self):
        self.stop.set()
        self.thread.join(5)


def take(records, n: int) -> list[dict]:
    return [next(records) for _ in range(n)]


def test_a_trace_not_created_yet_is_waited_for(tmp_path):
    path = tmp_path / "run.jsonl"
    records = Follower(path)
    first = next(records)
    assert first["type"] == FOLLOW and first["what"] == WAITING and first["message"] == f"waiting for {path}"
    path.write_bytes(lines("one", 2))
    got = take(records, 3)
    assert [r["type"] for r in got] == ["header", "step", "step"] and got[2]["step"] == 2
    records.close()


def rewrite_in_place(path, data: bytes) -> None:
    with open(path, "wb") as handle:  # what `open(trace, "w")` does when the program runs again: same inode
        handle.write(data)


def replace(path, data: bytes) -> None:
    fresh = path.with_suffix(".tmp")
    fresh.write_bytes(data)
    os.replace(fresh, path)  # a new file under the same name


def test_a_rewritten_trace_is_read_again_from_the_top(tmp_path):
    for rewrite in (rewrite_in_place, replace):
        for second in (lines("two", 1), lines("two", 6)):  # shorter than what was read, or longer: overtaken
            path = tmp_path / "run.jsonl"
            path.write_bytes(lines("one", 3))
            records = Follower(path)
            assert [r.get("run") for r in take(records, 4)] == [None, "one", "one", "one"]
            records.idle()
            rewrite(path, second)
            said = next(records)
            assert said["type"] == FOLLOW and said["what"] == REWRITTEN, (rewrite.__name__, said)
            assert "rewritten" in said["message"] and "from the top" in said["message"]
            again = take(records, second.count(b"\n"))
            assert again[0]["type"] == "header"
            assert [r["run"] for r in again[1:]] == ["two"] * (second.count(b"\n") - 1)
            records.idle()
            records.close()
            path.unlink()


def test_a_rewrite_with_another_header_is_seen_at_once(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(lines("one", 2))
    records = Follower(path)
    take(records, 3)
    records.idle()
    rewrite_in_place(path, lines("two", 5, {"model": "a longer header than before"}))
    assert next(records)["what"] == REWRITTEN
    assert next(records)["model"] == "a longer header than before"
    records.close()


def test_lines_appended_to_the_same_file_are_not_a_rewrite(tmp_path):
    path = tmp_path / "run.jsonl"
    data = lines("one", 4)
    cut = data.index(b"\n", data.index(b"\n") + 1) + 1 + 10  # header, step 1, and 10 bytes of step 2
    path.write_bytes(data[:cut])
    records = Follower(path)
    assert [r["type"] for r in take(records, 2)] == ["header", "step"]
    records.idle()
    with open(path, "ab") as handle:
        handle.write(data[cut:])
    assert [r["step"] for r in take(records, 3)] == [2, 3, 4]
    records.idle()  # nothing more: in particular no REWRITTEN
    records.close()
