"""The live source of `kvtui watch -- COMMAND` (the TUI): a command's process tree as one stream of records.
The hook, the server and the trace merge are in tree.py (imported in every process of the tree, so kept light)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from ..records.child import ChildSource
from ..records.codec import diagnostic_record, sharded_step_record
from ..records.stream import format_command
from .tree import (
    Naming,
    ProcessRun,
    TreeServer,
    declared_heads,
    desync,
    environment,
    hook_directory,
    merge,
    rank_desync,
    rank_facts,
    step_heads,
    tensor_parallel,
)


class TreeSource(ChildSource):
    """A command's process tree as one source for the watch TUI (`kvtui watch -- COMMAND`): the command runs
    in a session of its own, its stdout/stderr become "output" records (and its stdin is the TUI's input
    line), and every watched process's records arrive through a TreeServer and are made one stream by
    `Naming` (steps numbered in the order they arrive; the TUI's model filter, M, picks one process), and
    a command goes to every process (pause and step hold and release each rank
    at the same boundary: before its next forward, so a collective forward never waits on a held rank)."""

    supports = {"pause", "run", "step", "break", "verify", "watch"}

    def __init__(
        self,
        executable: str,
        args: list[str],
        *,
        top_k: int = 10,
        paused: bool = False,
        break_on_alarm: bool = False,
        listen: str | None = None,
        trace=None,
        cwd: str | None = None,
        attention: bool = False,
    ):
        self.argv = [executable, *args]
        self.trace = trace
        self._lock = threading.Lock()
        self._naming = Naming()
        self._stopped = False
        self._rank_facts: dict[int, list[tuple]] = {}  # rank -> (fed ids, positions, cache length) per forward
        self._desync_raised = False
        self._held: dict[int, int] = {}  # pid -> the process's step it is held after (a "paused" record)
        self._heads: dict[int, dict[str, int | None]] = {}  # pid -> its models' KV heads (model records)
        host, _, port = (listen or "127.0.0.1:0").rpartition(":")
        self.server = TreeServer(host, int(port), on_record=self._arrived)
        self._hook_dir = hook_directory()
        env = environment(
            Path(self._hook_dir.name),
            self.server.address,
            self.server.token,
            top_k,
            paused=paused,
            break_on_alarm=break_on_alarm,
            attention=attention,
        )
        self._read_process(
            subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**env, "PYTHONUNBUFFERED": "1"},
                cwd=cwd,
                start_new_session=True,
            )
        )
        threading.Thread(target=self._ended, name="kvtui-tree-end", daemon=True).start()

    def _ended(self) -> None:
        """When the command has ended and its processes have said goodbye, the stream is done."""
        self.process.wait()
        self.server.wait(timeout=5.0)
        self._queue.put(None)

    def _arrived(self, run: ProcessRun, record: dict | None) -> None:
        if record is None:  # its connection ended: the others keep going
            self._queue.put(
                {
                    "type": "notice",
                    "severity": "information" if run.finished else "warning",
                    "text": f"{run.name} ended"
                    + ("" if run.finished else " mid-run without its exit handlers (killed?)"),
                }
            )
            return
        kind, pid = record.get("type"), run.pid
        if kind == "program-exit":
            return
        desync = None
        with self._lock:
            if kind == "paused":
                self._held[pid] = record.get("step", 0)
            elif kind == "model":
                declared_heads(record, self._heads.setdefault(pid, {}))
            elif kind == "step":
                self._held.pop(pid, None)
                # a rank's shard shown as the logical layer (ranks × heads per rank), as its replay does
                ranks = tensor_parallel(run.world_size, step_heads(self._heads.get(pid, {}), record), record)
                if ranks:
                    record = sharded_step_record(record, ranks)
            record = self._naming(run, record)
            if kind == "step":
                desync = self._check_ranks(run, record)
        self._queue.put(record)
        if desync:
            self._queue.put(desync)

    def _check_ranks(self, run: ProcessRun, record: dict) -> dict | None:
        """rank-desync, live: once every rank of the run has made forward k, `rank_desync` compares them (the
        first disagreement only: what follows comes from it), numbered by the ranks' own forward k; the
        record lands at the stream's step that completed it. Called under the lock."""
        if run.rank is None or not run.world_size or self._desync_raised:
            return None
        facts = self._rank_facts.setdefault(run.rank, [])
        facts.append(rank_facts(record))
        index = len(facts) - 1
        if len(self._rank_facts) < run.world_size or any(len(f) <= index for f in self._rank_facts.values()):
            return None
        found = rank_desync(self._rank_facts, index)
        if not found:
            return None
        self._desync_raised = True
        return diagnostic_record(found[0], record["step"])

    def command(self, word: str, argument=None) -> None:
        if word == "verify" and not self._verify_safe():
            # a recompute on a sharded model is a collective forward: ranks that are not held at the same
            # boundary would pair it with another rank's decode step and hang
            self._queue.put(
                {
                    "type": "notice",
                    "severity": "warning",
                    "text": "verify on tensor-parallel "
                    "ranks runs when every rank is held at the same forward: pause (p), then v",
                }
            )
            return
        self.server.broadcast(format_command(word, argument))

    def _verify_safe(self) -> bool:
        """Verify on every rank at once is safe when no rank is sharded, or every rank is held after the
        same forward (then each runs its recompute, a collective forward, at the same boundary)."""
        with self._lock:
            ranks = [run for run in self.server.runs if (run.world_size or 1) > 1 and not run.finished]
            if not ranks:
                return True
            held = {self._held.get(run.pid) for run in ranks}
            return len(ranks) == ranks[0].world_size and None not in held and len(held) == 1

    def stop(self, grace: float = 2.0) -> None:
        """End the whole tree: the connections close (each watched process ends itself), then the command's
        process group gets TERM, then KILL. The trace, if asked for, is written from what arrived."""
        if self._stopped:
            return
        self._stopped = True
        self.close_stdin()
        self.server.close()  # each watched process ends itself when its connection closes
        self._end_group(grace)
        if self.trace is not None:
            runs = self.server.sorted_runs()
            merge(runs, Path(self.trace), desync(runs))
        self._hook_dir.cleanup()
