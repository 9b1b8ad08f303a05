"""Watch every Python process of a command's tree: `kvtui watch -- COMMAND [ARGS]...`.

The way coverage.py measures subprocesses: an environment variable names the run, and a start-up hook
(a `sitecustomize.py` in a directory put first on PYTHONPATH, which every child inherits) runs in each
Python process the command starts: torchrun's ranks, pytest-xdist workers, `multiprocessing` spawn
children, whatever a shell script runs. The hook costs nothing until the process imports transformers'
modeling code; then it watches every causal LM the process builds (as `kvtui watch SCRIPT` does) and
records into its own part file. When the command ends, `merge` writes one trace: each process's
`process` record (pid, parent, argv, and rank / local_rank / world_size when torch.distributed's
launcher set them), then its records, every line naming its `pid` (and `rank`).

Not seen: a process started with `python -I`/`-E`/`-S` (no PYTHONPATH or site), and a child made by
`fork` without exec (it inherits the parent's watcher, whose trace writer thread did not survive the fork).
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ENV = "KVTUI_WATCH_TREE"  # JSON: {"parts": directory of the part files, "top_k": N}
TRIGGER = "transformers.modeling_utils"  # where PreTrainedModel lives: imported before any model is built
TOKENIZERS = "transformers.tokenization_utils_base"  # a tokenizer may be loaded before any model code
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

HOOK = '''\
"""kvtui watch's start-up hook (see kvtui/engine/tree.py): watch this process, then run the next
sitecustomize on the path, if there is one."""
import os as _os
import sys as _sys


def _kvtui_start():
    here = _os.path.dirname(_os.path.abspath(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != here]  # the program sees its own path
    try:
        try:
            from kvtui.engine import tree
        except ImportError:  # an interpreter that has no kvtui installed: the one that started the run
            _sys.path.append(KVTUI_HOME)
            from kvtui.engine import tree
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


def environment(parts: Path, top_k: int, base: dict | None = None) -> dict:
    """The environment a watched command runs with: the hook's directory first on PYTHONPATH, and ENV."""
    env = dict(os.environ if base is None else base)
    hook_dir = parts / "hook"
    hook_dir.mkdir(parents=True, exist_ok=True)
    kvtui_home = str(Path(__file__).resolve().parent.parent.parent)  # the directory that holds kvtui/
    (hook_dir / "sitecustomize.py").write_text(f"KVTUI_HOME = {kvtui_home!r}\n" + HOOK, encoding="utf-8")
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), *filter(None, [env.get("PYTHONPATH")])])
    env[ENV] = json.dumps({"parts": str(parts), "top_k": top_k})
    return env


# ---- in each process of the tree ------------------------------------------------------------------------


def start_in_process() -> None:
    """Called by the hook: when transformers' tokenizer code loads, remember the tokenizers this process
    loads; when its modeling code loads, watch every causal LM it builds."""
    config = json.loads(os.environ[ENV])
    for module, part in ((TOKENIZERS, "install_tokenizers"), (TRIGGER, "install_models")):
        then = (lambda part=part: getattr(_watcher(config), part)())
        if module in sys.modules:  # imported already (a hook run twice): at once
            then()
        else:
            sys.meta_path.insert(0, _AfterImport(module, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` right after the module `name` has executed, once; finds nothing itself."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once, and not while the real finders look
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then
        return spec


_RUN: dict = {}  # this process's watcher and its part file's facts


def _watcher(config: dict):
    """This process's AutoAttach (its watcher, its part file), made at the first trigger."""
    from .probe import AutoAttach, Watcher

    if _RUN.get("pid") != os.getpid():
        parts, pid = Path(config["parts"]), os.getpid()
        watcher = Watcher(trace=str(parts / f"{pid}.jsonl"), top_k=int(config.get("top_k", 10)),
                          program=list(sys.argv))
        facts = {"type": "process", "pid": pid, "ppid": os.getppid(), "argv": list(sys.argv),
                 **{name.lower(): int(os.environ[name]) for name in RANK_VARIABLES
                    if os.environ.get(name, "").isdigit()}}
        _RUN.update(pid=pid, watcher=watcher, attach=AutoAttach(watcher), facts=facts, parts=parts)
        _write_facts()
        atexit.register(_finish)
    return _RUN["attach"]


def _write_facts(**more) -> None:
    facts = {**_RUN["facts"], **more}
    path = _RUN["parts"] / f"{_RUN['pid']}.process.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(facts), encoding="utf-8")
    tmp.replace(path)


def _finish() -> None:
    """At exit: flush the trace part and say what was watched."""
    watcher = _RUN.get("watcher")
    if watcher is None or _RUN.get("pid") != os.getpid():
        return
    models = [f"{p.name} ({type(p.model).__name__})" for p in watcher.probes]
    steps = watcher.steps
    watcher.detach()  # closes the recorder: every step is on disk
    _write_facts(models=models, steps=steps, finished=True)


# ---- in the parent: one trace from the parts ---------------------------------------------------------------


@dataclass
class ProcessRun:
    """One process of the tree that imported transformers' modeling code, as its part files tell."""

    pid: int
    argv: list[str]
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    ppid: int | None = None
    models: list[str] = field(default_factory=list)
    steps: int = 0
    finished: bool = False  # its exit handler ran (False: killed, os._exit, or still running)
    diagnostics: list[dict] = field(default_factory=list)  # every alarm its trace part holds
    records: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"rank {self.rank} (pid {self.pid})" if self.rank is not None else f"pid {self.pid}"


def read_parts(parts: Path) -> list[ProcessRun]:
    """Every process that imported transformers' modeling code, by rank then pid, with its records."""
    runs = []
    for facts_path in parts.glob("*.process.json"):
        facts = json.loads(facts_path.read_text(encoding="utf-8"))
        run = ProcessRun(pid=facts["pid"], argv=facts.get("argv", []), rank=facts.get("rank"),
                         local_rank=facts.get("local_rank"), world_size=facts.get("world_size"),
                         ppid=facts.get("ppid"), models=facts.get("models", []), finished=facts.get("finished", False))
        run.records = _part_records(parts / f"{run.pid}.jsonl")
        run.steps = sum(1 for r in run.records if r["type"] == "step")
        for record in run.records:
            if record["type"] == "step":
                run.diagnostics += [{**d, "step": record["step"]} for d in record.get("diagnostics", [])]
            elif record["type"] == "diagnostic":
                run.diagnostics.append(record)
        runs.append(run)
    return sorted(runs, key=lambda run: (run.rank is None, run.rank or 0, run.pid))


def _part_records(path: Path) -> list[dict]:
    """A part's records in their order; a line cut short by a kill ends it (the finished lines stay)."""
    from .trace import TraceError, iter_records

    records: list[dict] = []
    if not path.exists():
        return records
    try:
        for _, record in iter_records(path):
            records.append(record)
    except TraceError:
        pass
    return records


def desync(runs: list[ProcessRun]) -> list:
    """rank-desync: the first forward at which the ranks of the run disagree (what follows comes from it)."""
    from .diagnostics import check_ranks

    ranked = {run.rank: [r for r in run.records if r["type"] == "step"] for run in runs
              if run.rank is not None and run.models}
    if len(ranked) < 2:
        return []
    for index in range(max(len(steps) for steps in ranked.values())):
        facts = {rank: (tuple(steps[index]["input_ids"]), tuple(steps[index]["positions"]),
                        steps[index]["cache_seq_length"]) if index < len(steps) else None
                 for rank, steps in ranked.items()}
        found = check_ranks(index + 1, facts)
        if found:
            return found
    return []


def merge(runs: list[ProcessRun], out: Path, alarms: list = ()) -> None:
    """One trace: a run header, then per process its `process` record and its records, each naming its pid;
    then the run's own alarms (rank-desync)."""
    from .trace import TraceWriter, header_start

    watched = [run for run in runs if run.records]
    header = {**(watched[0].records[0] if watched else header_start()), "processes": len(watched)}
    writer = TraceWriter(out, header)
    try:
        for run in watched:
            writer.write({"type": "process", "pid": run.pid, "ppid": run.ppid, "argv": run.argv, "rank": run.rank,
                          "local_rank": run.local_rank, "world_size": run.world_size, "models": run.models,
                          "steps": run.steps, "finished": run.finished})
            tag = {"pid": run.pid, **({"rank": run.rank} if run.rank is not None else {})}
            for record in run.records:
                if record.get("type") == "header":
                    record = {**record, "type": "process-header"}  # the process's own header, kept whole
                writer.write({**record, **tag})
        for d in alarms:
            writer.write({"type": "diagnostic", "step": d.step, "code": d.code, "severity": d.severity,
                          "message": d.message})
    finally:
        writer.close()
