"""The live source of `kvtui watch -- COMMAND` (the TUI): a command's process tree as one stream of records.
The hook, the server and the trace merge are in tree.py (imported in every process of the tree, so kept light)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from .diagnostics import check_ranks
from .stream import ChildSource
from .tree import ProcessRun, TreeServer, desync, environment, merge

class TreeSource(ChildSource):
    """A command's process tree as one source for the watch TUI (`kvtui watch -- COMMAND`): the command runs
    in a session of its own, its stdout/stderr become "output" records (and its stdin is the TUI's input
    line), and every watched process's records arrive through a TreeServer. Records are made one stream:
    steps numbered in the order they arrive (the process's own number kept as `process_step`), each
    process's caches and models named with the process (`rank 1 (pid 42) · MODEL`: the TUI's model filter,
    M, picks one process), and a command goes to every process (pause and step hold and release each rank
    at the same boundary: before its next forward, so a collective forward never waits on a held rank)."""

    supports = {"pause", "run", "step", "break", "verify", "watch"}

    def __init__(self, executable: str, args: list[str], *, top_k: int = 10, paused: bool = False,
                 break_on_alarm: bool = False, listen: str | None = None, trace=None, cwd: str | None = None):
        self.argv = [executable, *args]
        self.trace = trace
        self._lock = threading.Lock()
        self._steps = 0
        self._global: dict[tuple[int, int], int] = {}  # (pid, the process's step) -> the stream's step
        self._last: dict[int, int] = {}  # pid -> the stream's number of its newest step
        self._stopped = False
        self._rank_facts: dict[int, list[tuple]] = {}  # rank -> (fed ids, positions, cache length) per forward
        self._desync_raised = False
        host, _, port = (listen or "127.0.0.1:0").rpartition(":")
        self.server = TreeServer(host, int(port), on_record=self._arrived)
        self._hook_dir = tempfile.TemporaryDirectory(prefix="kvtui-watch-tree-")
        env = environment(Path(self._hook_dir.name), self.server.address, self.server.token, top_k,
                          paused=paused, break_on_alarm=break_on_alarm)
        self._read_process(subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=cwd,
                                            start_new_session=True))
        threading.Thread(target=self._ended, name="kvtui-tree-end", daemon=True).start()

    def _ended(self) -> None:
        """When the command has ended and its processes have said goodbye, the stream is done."""
        self.process.wait()
        self.server.wait(timeout=5.0)
        self._queue.put(None)

    def _arrived(self, run: ProcessRun, record: dict | None) -> None:
        if record is None:
            return
        tag, kind, pid = run.name, record.get("type"), run.pid
        desync = None
        record = {**record, "pid": pid, **({"rank": run.rank} if run.rank is not None else {})}
        with self._lock:
            if kind == "step":
                self._steps += 1
                self._global[(pid, record["step"])] = self._last[pid] = self._steps
                record["process_step"], record["step"] = record["step"], self._steps
                desync = self._check_ranks(run, record)
            elif isinstance(record.get("step"), int):
                record["step"] = self._global.get((pid, record["step"]), self._last.get(pid, 0))
        if kind in ("step", "cache"):
            record["model"] = f"{tag} · {record['model']}" if record.get("model") else tag
            if record.get("cache_id"):
                record["cache_id"] = f"{tag}: {record['cache_id']}"
            if record.get("parent"):
                record["parent"] = f"{tag}: {record['parent']}"
            lineage = record.get("lineage")
            if isinstance(lineage, dict) and lineage.get("parent"):
                record["lineage"] = {**lineage, "parent": f"{tag}: {lineage['parent']}"}
        elif kind == "notice":
            record["text"] = f"{tag}: {record.get('text', '')}"
        elif kind == "program-exit":
            return
        self._queue.put(record)
        if kind == "step" and desync:
            self._queue.put(desync)

    def _check_ranks(self, run: ProcessRun, record: dict) -> dict | None:
        """rank-desync, live: once every rank of the run has made forward k, the rulebook compares them
        (the first disagreement only: what follows comes from it). Called under the lock."""
        if run.rank is None or not run.world_size or self._desync_raised:
            return None
        facts = self._rank_facts.setdefault(run.rank, [])
        facts.append((tuple(record["input_ids"]), tuple(record["positions"]), record["cache_seq_length"]))
        index = len(facts) - 1
        if len(self._rank_facts) < run.world_size or any(len(f) <= index for f in self._rank_facts.values()):
            return None
        found = check_ranks(record["process_step"], {rank: f[index] for rank, f in self._rank_facts.items()})
        if not found:
            return None
        self._desync_raised = True
        d = found[0]
        return {"type": "diagnostic", "step": record["step"], "code": d.code, "severity": d.severity,
                "message": d.message}

    def send(self, command: str) -> None:
        if command == "verify" and any((run.world_size or 1) > 1 for run in self.server.runs):
            # a recompute on a sharded model is a collective forward: ranks that are not held at the same
            # boundary would pair it with another rank's decode step and hang
            self._queue.put({"type": "notice", "severity": "warning", "text": "verify is not offered for "
                             "tensor-parallel ranks yet: its recompute is a collective forward every rank must "
                             "start at the same boundary"})
            return
        self.server.broadcast(command)

    def stop(self, grace: float = 2.0) -> None:
        """End the whole tree: the connections close (each watched process ends itself), then the command's
        process group gets TERM, then KILL. The trace, if asked for, is written from what arrived."""
        if self._stopped:
            return
        self._stopped = True
        self.close_stdin()
        if self.process.poll() is None:
            self.server.close()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            self.server.close()
        if self.trace is not None:
            runs = self.server.sorted_runs()
            merge(runs, Path(self.trace), desync(runs))
        self._hook_dir.cleanup()
