"""Watch every Python process of a command's tree: `kvtui watch -- COMMAND [ARGS]...`.

The way coverage.py measures subprocesses: an environment variable names the run, and a start-up hook
(a `sitecustomize.py` in a directory put first on PYTHONPATH, which every child inherits) runs in each
Python process the command starts: torchrun's ranks, pytest-xdist workers, `multiprocessing` spawn
children, whatever a shell script runs. The hook costs nothing until the process imports transformers'
tokenizer or modeling code; then it connects to the viewer (a `TreeServer`: loopback, or `--listen
HOST:PORT` for ranks on other machines, each connection proven by a one-time token) and watches every
causal LM the process builds, as `kvtui watch SCRIPT` does, streaming its trace records there. The viewer
keeps each process's records (`ProcessRun`) and `merge` writes one trace: each process's `process` record
(pid, parent, host, argv, and rank / local_rank / world_size when torch.distributed's launcher set them),
then its records, every line naming its `pid` (and `rank`). A watched process whose viewer is gone (quit,
crash, SIGKILL) ends itself: no rank is left behind.

Not seen: a process started with `python -I`/`-E`/`-S` (no PYTHONPATH or site), and a child made by
`fork` without exec (it inherits the parent's watcher, whose writers stop in the child: a fork's records
never mix into the parent's lines).
"""

from __future__ import annotations

import atexit
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .deferred import TOKENIZERS, TRIGGER, at_first_tokenizer_load, when_imported

ENV = "KVTUI_WATCH_TREE"  # JSON: {"connect": "HOST:PORT", "token", "top_k", "paused", "break_on_alarm", "attention"}
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
HELLO_TIMEOUT_S = 10.0

HOOK = '''\
"""kvtui watch's start-up hook (see kvtui/engine/watch/tree.py): watch this process, then run the next
sitecustomize on the path, if there is one."""
import os as _os
import sys as _sys


def _kvtui_start():
    here = _os.path.dirname(_os.path.abspath(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != here]  # the program sees its own path
    try:
        try:
            from kvtui.engine.watch import tree
        except ImportError:  # an interpreter that has no kvtui installed: the one that started the run
            _sys.path.append(KVTUI_HOME)
            from kvtui.engine.watch import tree
        tree.start_in_process()
    except Exception as error:  # never stop the program: say why it is not watched
        print(f"kvtui watch: process {_os.getpid()} not watched: {type(error).__name__}: {error}", file=_sys.stderr)
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _sys.path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        _sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_kvtui_start()
del _kvtui_start
'''


HOOK_PREFIX = "kvtui-watch-tree-"  # then the viewer's pid: a directory whose viewer is gone is swept


def hook_directory():
    """A temporary directory for the hook, named after this viewer's pid. Those that killed viewers left
    (a SIGKILL runs no cleanup) are removed first."""
    import tempfile

    sweep_hook_directories()
    return tempfile.TemporaryDirectory(prefix=f"{HOOK_PREFIX}{os.getpid()}-")


def sweep_hook_directories(root: Path | None = None) -> list[Path]:
    """Remove the hook directories under `root` (the temporary directory) whose viewer process is gone."""
    import shutil
    import tempfile

    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{HOOK_PREFIX}*-*"):
        pid = path.name[len(HOOK_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def environment(
    hook_dir: Path,
    connect: str,
    token: str,
    top_k: int,
    base: dict | None = None,
    paused: bool = False,
    break_on_alarm: bool = False,
    attention: bool = False,
) -> dict:
    """The environment a watched command runs with: the hook's directory first on PYTHONPATH, and ENV."""
    env = dict(os.environ if base is None else base)
    hook_dir.mkdir(parents=True, exist_ok=True)
    kvtui_home = str(Path(__file__).resolve().parent.parent.parent)  # the directory that holds kvtui/
    (hook_dir / "sitecustomize.py").write_text(f"KVTUI_HOME = {kvtui_home!r}\n" + HOOK, encoding="utf-8")
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), *filter(None, [env.get("PYTHONPATH")])])
    env[ENV] = json.dumps(
        {"connect": connect, "token": token, "top_k": top_k, "paused": paused, "break_on_alarm": break_on_alarm}
        | ({"attention": True} if attention else {})
    )
    return env


# ---- in each process of the tree ------------------------------------------------------------------------


def start_in_process() -> None:
    """Called by the hook: when transformers' tokenizer code loads, remember the tokenizers this process
    loads (from its first tokenizer load); when its modeling code loads, watch every causal LM it builds
    (deferred.py: never before the program's own imports reach transformers)."""
    config = json.loads(os.environ[ENV])

    def tokenizer_code_loaded() -> None:
        at_first_tokenizer_load(lambda: _watcher(config).install_tokenizers())

    when_imported(TOKENIZERS, tokenizer_code_loaded)
    when_imported(TRIGGER, lambda: _watcher(config).install_models())


_RUN: dict = {}  # this process's watcher and its connection to the viewer


def _watcher(config: dict):
    """This process's AutoAttach (its watcher, its connection), made at the first trigger. As a watched
    program's child does (watch/child.py child_main): records go to the viewer through one RecordPipe (a step is
    serialised once on the model's thread and written off it), and a control gate reads the viewer's
    commands (pause, run, step, break, verify, watch) from the same connection."""
    from ..records.stream import RecordPipe
    from .child import control_gate
    from .probe import AutoAttach, Watcher

    if _RUN.get("pid") != os.getpid():
        host, _, port = config["connect"].rpartition(":")
        connection = socket.create_connection((host, int(port)), timeout=HELLO_TIMEOUT_S)
        connection.settimeout(None)
        facts = {
            "type": "hello",
            "token": config["token"],
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "host": socket.gethostname(),
            "argv": list(sys.argv),
            **{name.lower(): int(os.environ[name]) for name in RANK_VARIABLES if os.environ.get(name, "").isdigit()},
        }
        connection.sendall(json.dumps(facts).encode() + b"\n")
        pipe = RecordPipe(os.dup(connection.fileno()))
        gate = control_gate(
            os.dup(connection.fileno()),
            pipe,
            bool(config.get("paused")),
            bool(config.get("break_on_alarm")),
            on_gone=_viewer_gone,
        )
        watcher = Watcher(
            top_k=int(config.get("top_k", 10)),
            gate=gate,
            program=list(sys.argv),
            attention=bool(config.get("attention")),
            on_snapshot=pipe.send,
            on_event=pipe.send,
        )
        _RUN.update(pid=os.getpid(), watcher=watcher, attach=AutoAttach(watcher), connection=connection, pipe=pipe)
        atexit.register(_finish)
    return _RUN["attach"]


def _viewer_gone() -> None:
    """The viewer closed its end (quit, crash, SIGKILL): this process ends too, unless it is already ending."""
    if not _RUN.get("finishing"):
        os.kill(os.getpid(), signal.SIGKILL)


def _finish() -> None:
    """At exit: every record is sent, then what was watched."""
    watcher = _RUN.get("watcher")
    if watcher is None or _RUN.get("pid") != os.getpid():
        return
    _RUN["finishing"] = True
    models = [f"{p.name} ({p.class_name})" for p in watcher.probes]
    steps = watcher.steps
    watcher.detach()
    _RUN["pipe"].send({"type": "process-end", "models": models, "steps": steps})
    _RUN["pipe"].close()  # its queue is written
    try:
        _RUN["connection"].close()
    except OSError:
        pass


# ---- in the viewer: the processes' records, and one trace of them -------------------------------------------


@dataclass
class ProcessRun:
    """One watched process of the tree, as its connection told."""

    pid: int
    argv: list[str]
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    ppid: int | None = None
    host: str | None = None
    # always given (the server makes a run for a connection it accepted); None is only the field's default
    connection: socket.socket = field(default=None, repr=False)  # type: ignore[assignment]
    send_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    models: list[str] = field(default_factory=list)
    steps: int = 0
    finished: bool = False  # it said goodbye at exit (False: killed, os._exit, or still running)
    diagnostics: list[dict] = field(default_factory=list)  # every alarm its trace part holds
    records: list[dict] = field(default_factory=list)

    def add(self, record: dict) -> None:
        self.records.append(record)
        if record["type"] == "step":
            self.steps += 1
            self.diagnostics += [{**d, "step": record["step"]} for d in record.get("diagnostics", [])]
        elif record["type"] == "diagnostic":
            self.diagnostics.append(record)

    @property
    def watched(self) -> bool:
        """It built a causal LM (it said so at exit) or ran a forward of one."""
        return bool(self.models or self.records)

    @property
    def name(self) -> str:
        return f"rank {self.rank} (pid {self.pid})" if self.rank is not None else f"pid {self.pid}"


class TreeServer:
    """The viewer's end: accepts the watched processes' connections (each proves itself with the token in
    its first line) and keeps each one's records as they arrive. A connection with a wrong token, or one
    that sends something that is not a record, is dropped with a line in `notes`; the run goes on."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None, on_record=None):
        """`on_record(run, record)`: called on the connection's thread for each record as it arrives (a
        live viewer); `on_record(run, None)` when a process's connection ends."""
        import secrets

        self.token = token or secrets.token_urlsafe(16)
        self.on_record = on_record
        self._socket = socket.create_server((host, port))
        host, port = self._socket.getsockname()[:2]
        self.address = f"{host}:{port}"
        self.runs: list[ProcessRun] = []
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self._open: set[threading.Thread] = set()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="kvtui-tree-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, peer = self._socket.accept()
            except OSError:
                return
            reader = threading.Thread(target=self._read, args=(connection, peer), name="kvtui-tree-read", daemon=True)
            with self._lock:
                self._open.add(reader)
            reader.start()

    def _read(self, connection: socket.socket, peer) -> None:
        where = "{}:{}".format(*peer[:2])
        run = None
        try:
            connection.settimeout(HELLO_TIMEOUT_S)
            lines = connection.makefile("rb")
            hello = _record(lines.readline())
            if (
                hello is None
                or hello.get("type") != "hello"
                or not hmac.compare_digest(str(hello.get("token", "")), self.token)
            ):
                self._note(f"dropped a connection from {where}: no valid token")
                return
            connection.settimeout(None)
            run = ProcessRun(
                pid=int(hello["pid"]),
                argv=list(hello.get("argv", [])),
                rank=hello.get("rank"),
                local_rank=hello.get("local_rank"),
                world_size=hello.get("world_size"),
                ppid=hello.get("ppid"),
                host=hello.get("host"),
                connection=connection,
            )
            with self._lock:
                self.runs.append(run)
            for raw in lines:
                record = _record(raw)
                if record is None:
                    self._note(f"dropped {run.name} from {where}: it sent something that is not a record")
                    return
                if record["type"] == "process-end":
                    run.models, run.finished = list(record.get("models", [])), True
                    continue
                run.add(record)
                if self.on_record is not None:
                    self.on_record(run, record)
        except (OSError, ValueError) as error:
            self._note(f"dropped a connection from {where}: {error}")
        finally:
            connection.close()
            if run is not None and self.on_record is not None:
                self.on_record(run, None)
            with self._lock:
                self._open.discard(threading.current_thread())

    def broadcast(self, command: str) -> None:
        """A command line to every watched process still connected (pause, run, step, break on|off, ...)."""
        with self._lock:
            runs = list(self.runs)
        for run in runs:
            try:
                with run.send_lock:
                    run.connection.sendall(command.encode() + b"\n")
            except OSError:
                pass  # that process has ended

    def _note(self, text: str) -> None:
        with self._lock:
            self.notes.append(text)

    def wait(self, timeout: float) -> bool:
        """Wait until every connection has ended (True), or `timeout` seconds have passed (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._open:
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Stop listening and close every connection: the processes still watched end themselves."""
        self._closed = True
        try:  # a close alone does not wake a thread blocked in accept() (Linux): the shutdown does
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=2.0)
        with self._lock:
            runs = list(self.runs)
        for run in runs:
            try:
                run.connection.close()
            except OSError:
                pass

    def sorted_runs(self) -> list[ProcessRun]:
        with self._lock:
            return sorted(self.runs, key=lambda run: (run.rank is None, run.rank or 0, run.host or "", run.pid))


def _record(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("type"), str) else None


def rank_facts(step: dict) -> tuple:
    """What every rank of a collective forward must agree on, read from its step record: (fed ids, positions,
    cache length after the forward)."""
    return (tuple(step["input_ids"]), tuple(step["positions"]), step["cache_seq_length"])


def rank_desync(facts: dict[int, list[tuple]], index: int) -> list:  # Diagnostics
    """rank-desync at the ranks' forward `index` (0-based; a rank that made no such forward is named as
    missing). `facts`: rank -> its forwards' `rank_facts`, in order. Used by the trace (`desync`) and the
    live view (tree_source.py) alike.

    The alarm is numbered index + 1: the ranks' own step number, the same on every rank (each process
    counts its forwards from 1, and every rank runs the same collective forwards), not the stream's numbers
    (which interleave the ranks in the order their records arrive: rank 0's forward 3 may be step 5 or 6).
    Where it lands in the stream is the caller's choice: `merge` puts it at the first rank's step, the
    live view at the step that completed the forward."""
    from ..reading.diagnostics import check_ranks  # here, not at the top: every process of the tree imports tree.py

    return check_ranks(
        index + 1, {rank: forwards[index] if index < len(forwards) else None for rank, forwards in facts.items()}
    )


def desync(runs: list[ProcessRun]) -> list:
    """rank-desync: the first forward at which the ranks of the run disagree (what follows comes from it)."""
    ranked = {
        run.rank: [rank_facts(r) for r in run.records if r["type"] == "step"]
        for run in runs
        if run.rank is not None and run.watched
    }
    if len(ranked) < 2:
        return []
    for index in range(max(len(forwards) for forwards in ranked.values())):
        found = rank_desync(ranked, index)
        if found:
            return found
    return []


def sharded_ranks(runs: list[ProcessRun]) -> tuple[list[ProcessRun], int, list[list[int]]] | None:
    """The ranks that split the KV heads (at least two whose shards of layer 0 at their last common forward
    differ only in the head axis, with as many heads each): (those runs, that forward's index, their K
    shapes [batch, heads, slots, head_dim]); None otherwise. The live summary and the trace read it alike."""
    ranked = [
        (run, steps)
        for run in runs
        if run.rank is not None and run.watched
        for steps in [[r for r in run.records if r["type"] == "step" and r.get("layers")]]
        if steps
    ]
    if len(ranked) < 2:
        return None
    last = min(len(steps) for _, steps in ranked) - 1
    shapes = [steps[last]["layers"][0].get("k_shape") for _, steps in ranked]
    if any(not shape or len(shape) != 4 for shape in shapes):
        return None
    heads = [shape[1] for shape in shapes]
    if any(shape[:1] + shape[2:] != shapes[0][:1] + shapes[0][2:] for shape in shapes) or len(set(heads)) != 1:
        return None
    # ranks that each hold the whole model (data parallel) look the same: the model's own KV heads decide,
    # where its record says them (a trace from before they were recorded is taken as the shapes say)
    declared = {r.get("kv_heads") for run, _ in ranked for r in run.records if r["type"] == "model"} - {None}
    if declared and declared != {heads[0] * len(ranked)}:
        return None
    return [run for run, _ in ranked], last, shapes


def tensor_parallel(world_size: int | None, kv_heads: int | None, step: dict) -> int | None:
    """Over how many ranks one rank's `step` record holds a shard of its model's KV heads: `world_size`, where its
    layer 0's K [batch, heads, slots, head_dim] holds kv_heads / world_size heads (tensor parallelism splits the
    heads evenly); None for a rank that holds them all (data parallel, one process) or a model whose heads are not
    known. The one judgement of the live view (tree_source.py) and the trace's merge: both then show the logical
    layer, ranks × heads per rank (StepSnapshot.tensor_parallel)."""
    if not world_size or world_size < 2 or not kv_heads:
        return None
    layers = step.get("layers") or ()
    shape = layers[0].get("k_shape") if layers else None
    if not shape or len(shape) != 4:
        return None
    return world_size if shape[1] * world_size == kv_heads else None


def declared_heads(record: dict, heads: dict[str, int | None]) -> None:
    """Note a process's `model` record's KV heads in `heads` (model name -> its heads), for `tensor_parallel`."""
    if record.get("type") == "model":
        heads[str(record.get("name"))] = record.get("kv_heads")


def step_heads(heads: dict[str, int | None], step: dict) -> int | None:
    """The KV heads of the model a process's step ran (a step names its model only where the process has
    several; else the one model's)."""
    named = step.get("model")
    if named is not None and str(named) in heads:
        return heads[str(named)]
    values = set(heads.values())
    return values.pop() if len(values) == 1 else None


def shards(runs: list[ProcessRun]) -> str | None:
    """The ranks' shards of layer 0 at their last common forward, merged into the logical layer
    (`K 1×2×27×16 · 2 ranks × 1 head`), when the ranks split the KV heads; None otherwise."""
    found = sharded_ranks(runs)
    if found is None:
        return None
    ranked, last, shapes = found
    batch, heads, length, dim = shapes[0]
    return (
        f"K {batch}×{heads * len(ranked)}×{length}×{dim} · {len(ranked)} ranks × {heads} head"
        f"{'s' if heads != 1 else ''} (layer 0, forward {last + 1})"
    )


class Naming:
    """Many processes' records made one stream, the same for the live view and the trace: steps numbered
    in the order they come (each keeps its process's own number as `process_step`; a record that names a
    step gets the stream's number of it), each process's caches and models named with the process
    (`rank 1 (pid 42): DynamicCache#1`, `rank 1 (pid 42) · MODEL`: caches of different processes never
    share a buffer in replay, and the model filter picks a process), every record tagged with `pid`/`rank`."""

    def __init__(self):
        self._steps = 0
        self._global: dict[tuple[int, int], int] = {}  # (pid, the process's step) -> the stream's step
        self._last: dict[int, int] = {}  # pid -> the stream's number of its newest step

    def stream_step(self, pid: int, step: int) -> int:
        return self._global.get((pid, step), step)

    def __call__(self, run: ProcessRun, record: dict) -> dict:
        tag, kind, pid = run.name, record.get("type"), run.pid
        record = {**record, "pid": pid, **({"rank": run.rank} if run.rank is not None else {})}
        if kind == "step":
            self._steps += 1
            self._global[(pid, record["step"])] = self._last[pid] = self._steps
            record["process_step"], record["step"] = record["step"], self._steps
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
        return record


def merge(runs: list[ProcessRun], out: Path, alarms: list | tuple = ()) -> None:  # alarms: Diagnostics
    """One trace: a run header, then per process its `process` record and its records (made one stream by
    `Naming`: steps numbered through the run); then the run's own alarms (rank-desync), at their steps.
    Where a rank's step holds a shard of the KV heads (`tensor_parallel`, the live view's judgement too), the
    header and that step say over how many ranks, so a replay shows the model's heads in all, as the live view
    does.
    Written here with a TraceWriter, not through the Recorder (which writes one session's or one
    watcher's trace): the records are the processes' own, already made, only joined and renumbered."""
    from ..records.codec import diagnostic_record, sharded_step_record
    from ..records.trace import TraceWriter, header_start

    watched = [run for run in runs if run.records]  # a header is their first record
    # per process, each step's shard count: the live view's judgement (tensor_parallel), kept in the trace
    sharded: dict[tuple[int, int], int] = {}  # (pid, index of the record) -> ranks
    for run in watched:
        heads: dict[str, int | None] = {}
        for index, record in enumerate(run.records):
            declared_heads(record, heads)
            if record.get("type") == "step":
                ranks = tensor_parallel(run.world_size, step_heads(heads, record), record)
                if ranks:
                    sharded[(run.pid, index)] = ranks
    header = {**(watched[0].records[0] if watched else header_start()), "processes": len(watched)}
    if sharded:
        header["tensor_parallel"] = max(sharded.values())
    writer = TraceWriter(out, header)
    naming = Naming()
    try:
        for run in watched:
            writer.write(
                {
                    "type": "process",
                    "pid": run.pid,
                    "ppid": run.ppid,
                    "host": run.host,
                    "argv": run.argv,
                    "rank": run.rank,
                    "local_rank": run.local_rank,
                    "world_size": run.world_size,
                    "models": run.models,
                    "steps": run.steps,
                    "finished": run.finished,
                }
            )
            for index, record in enumerate(run.records):
                if record.get("type") == "header":
                    record = {**record, "type": "process-header"}  # the process's own header, kept whole
                elif (run.pid, index) in sharded:
                    record = sharded_step_record(record, sharded[(run.pid, index)])
                writer.write(naming(run, record))
        first = next((run for run in watched if run.rank is not None), None)
        for d in alarms:  # at the stream's number of the first rank's forward where the ranks parted
            step = naming.stream_step(first.pid, d.step) if first is not None else d.step
            writer.write(diagnostic_record(d, step))
    finally:
        writer.close()
