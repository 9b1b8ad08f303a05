"""`kvtui compare`: the same greedy chat under several cache strategies, each in its own engine process,
advanced in lockstep (one forward at a time, in turn) so they never compete for the same cores.

No Textual and no Rich here: the CLI prints the table, the compare app draws it; both read `Lane`s.

Strategies: none (no cache object: every step a full forward over the whole context), dynamic
(DynamicCache), static (StaticCache), static+compile (StaticCache and torch.compile'd decode steps), press:SPEC
(a DynamicCache whose first prefill a kvpress press compresses, `--press SPEC`: after each turn the lane verifies,
and its cost, top-1 agreement and KL against the uncompressed recompute, is kept).
Each lane is a real engine process (kvtui/engine/chat/host.py) speaking
engine/records/stream.py's protocol: `send` prefills a
turn, `step` feeds one token; each answers with its step record(s) and a `state` record.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .engine.records.token_bytes import learn_bytes, shown_text, token_bytes

STRATEGIES = ("none", "dynamic", "static", "static+compile")
ENGINE_OVERHEAD = 600 * 2**20  # what an engine process holds besides the weights (torch, transformers, buffers)
EDGE = 5  # decode steps averaged for "ms per token at the start / end of the context"


class CompareError(ValueError):
    """Bad input to compare: one line, said before any engine starts."""


def parse_strategies(text: str) -> tuple[str, ...]:
    from .engine.chat.press_spec import PressSpecError, parse_press

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise CompareError("--caches needs at least one strategy: " + ", ".join(STRATEGIES) + ", press:SPEC")
    parsed = []
    for name in names:
        if name.startswith("press:"):
            try:
                name = "press:" + parse_press(name.removeprefix("press:")).text
            except PressSpecError as exc:
                raise CompareError(f"--caches {name}: {exc}") from None
        elif name not in STRATEGIES:
            raise CompareError(
                f"unknown cache strategy {name!r} in --caches: use {', '.join(STRATEGIES)} or press:SPEC (e.g. "
                f"press:knorm:0.5)"
            )
        parsed.append(name)
    names = tuple(parsed)
    if len(set(names)) != len(names):
        raise CompareError(f"--caches names a strategy twice: {text}")
    return names


def compile_problem(device: str = "cpu") -> str | None:
    """Why torch.compile cannot run here (None when it can): inductor needs a supported Python and, on CPU,
    a C++ compiler to build its kernels."""
    import torch

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python ({sys.version.split()[0]})"
    if device.startswith("cpu") or device == "auto" and not torch.cuda.is_available():
        compiler = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
        if compiler is None or not shutil.which(compiler):
            return "torch.compile on CPU needs a C++ compiler (g++ or clang++), and none is on PATH"
    return None


def model_bytes(model: str | None) -> int | None:
    """The weights' size once loaded in float32 on CPU, from the files (None when it cannot be told)."""
    from .engine.models.embedded import embedded_cache_dir, find_embedded_gguf, is_complete

    try:
        if model is None:
            converted = embedded_cache_dir()
            if is_complete(converted):
                return _weights_size(converted)
            return find_embedded_gguf().stat().st_size * 8  # Q4 -> float32
        path = Path(model)
        if path.is_file() and path.suffix == ".gguf":
            return path.stat().st_size * 8
        if path.is_dir():
            return _weights_size(path)
    except Exception:  # noqa: BLE001  a model the loader will explain better
        return None
    return None


def _weights_size(directory: Path) -> int | None:
    files = [p for p in directory.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
    if not files:
        return None
    size = sum(p.stat().st_size for p in files)
    config = directory / "config.json"
    if config.exists():
        import json

        data = json.loads(config.read_text())
        if str(data.get("torch_dtype") or data.get("dtype") or "").endswith(("float16", "bfloat16")):
            size *= 2  # loaded as float32 on CPU
    return size


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(model: str | None, engines: int, available: int | None = None) -> None:
    weights = model_bytes(model)
    available = memory_available() if available is None else available
    if weights is None or available is None:
        return
    needed = engines * (weights + ENGINE_OVERHEAD)
    if needed > available:
        gib = 2**30
        raise CompareError(
            f"{engines} engines need about {needed / gib:.1f} GiB ({weights / gib:.1f} GiB of weights "
            f"each, plus about {ENGINE_OVERHEAD / gib:.1f} GiB per process) but only "
            f"{available / gib:.1f} GiB is available: compare fewer strategies"
        )


def lane_options(strategy: str, base: dict) -> dict:
    """The complete options of one lane's engine: the defaults, then `base`, then the strategy's cache."""
    from .options import DEFAULT_OPTIONS

    options = {**DEFAULT_OPTIONS, **base}
    press = strategy.removeprefix("press:") if strategy.startswith("press:") else None
    options["cache"] = "static" if strategy.startswith("static") else "dynamic" if press else strategy
    options["compile_decode"] = strategy == "static+compile"
    options["press"] = press
    return options


def trace_name(strategy: str) -> str:
    return f"compare-{strategy.replace('+', '-').replace(':', '-')}.jsonl"


@dataclass
class Point:
    context: int  # tokens the step's forward attended to (cache + fed, or the whole context with no cache)
    ms: float  # the forward's own time
    phase: str
    compile: bool = False


@dataclass
class Lane:
    """One strategy's engine and everything its records said."""

    strategy: str
    description: str = ""
    points: list[Point] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)  # the token chosen at every step, in order
    turns: list[list[int]] = field(default_factory=list)  # the ids each turn generated
    reply: list[bytes] = field(default_factory=list)  # the bytes of the tokens the current turn generated
    token_bytes: dict[int, bytes] = field(default_factory=dict)  # learned from the step records' "bytes"
    cache_bytes: int = 0
    cache_length: int = 0
    context: int = 0
    compile_ms: float = 0.0
    recompiles: int = 0
    turn_done: bool = True
    held: int = 0  # press lanes: the most slots a layer holds (of `context` fed)
    costs: list[tuple[float, bool]] = field(default_factory=list)  # press lanes: each turn's verify (KL, top-1 agrees)
    error: str | None = None
    source: object = None  # the EngineSource
    records: object = None  # its record iterator

    @property
    def reply_text(self) -> str:
        """The current turn's reply, decoded once from its bytes (a split character comes back whole; one not
        complete yet at the end is shown as its bytes)."""
        return shown_text(b"".join(self.reply))

    @property
    def press(self) -> bool:
        return self.strategy.startswith("press:")

    def cost_line(self) -> str | None:
        """A press lane's cost in words (None for other lanes, or before its first verify)."""
        if not self.press or not self.costs:
            return None
        agree = sum(1 for _, same in self.costs if same)
        kls = ", ".join(f"{kl:.4g}" for kl, _ in self.costs)
        mean = sum(kl for kl, _ in self.costs) / len(self.costs)
        return (
            f"{self.strategy}: holds at most {self.held} of {self.context} tokens fed per layer; against the "
            f"uncompressed recompute after each turn, top-1 agrees {agree}/{len(self.costs)}, KL(full ‖ compressed) "
            f"{kls} nats (mean {mean:.4g})"
        )

    @property
    def decode(self) -> list[Point]:
        return [p for p in self.points if p.phase == "decode" and not p.compile]

    @property
    def tokens_per_s(self) -> float | None:
        decode = self.decode
        total = sum(p.ms for p in decode)
        return len(decode) * 1000 / total if total else None

    def edge_ms(self, end: bool) -> tuple[float, int] | None:
        """(median ms per token, context length) of the first or last EDGE decode steps."""
        decode = self.decode
        if not decode:
            return None
        part = decode[-EDGE:] if end else decode[:EDGE]
        return statistics.median(p.ms for p in part), part[-1 if end else 0].context


class Comparison:
    """Start one engine per strategy, then run the script's turns through all of them in lockstep."""

    def __init__(
        self,
        model: str | None,
        strategies: tuple[str, ...],
        options: dict,
        trace_dir: Path,
        on_update: Callable[[Comparison, Lane | None], None] | None = None,
    ):
        self.model, self.strategies, self.options, self.trace_dir = model, strategies, options, trace_dir
        self.lanes = [Lane(s) for s in strategies]
        self.on_update = on_update or (lambda comparison, lane: None)
        self.turn = 0
        self.turns_total = 0
        self.stopped = False
        self.going = threading.Event()  # cleared: paused between two rounds of forwards (p in the screen)
        self.going.set()

    # ---- engines ----------------------------------------------------------------------------------------

    def start(self) -> None:
        from .engine.chat.host import EngineSetup, EngineSource

        self.trace_dir.mkdir(parents=True, exist_ok=True)
        for lane in self.lanes:
            lane.source = EngineSource(
                EngineSetup(
                    model=self.model,
                    options=lane_options(lane.strategy, self.options),
                    trace_path=str(self.trace_dir / trace_name(lane.strategy)),
                )
            )
            lane.records = lane.source.records()
        for lane in self.lanes:  # they load side by side; each says ready or why not
            for record in lane.records:
                if record.get("type") == "ready":
                    lane.description = record.get("description", "")
                    break
                if record.get("type") == "load-failed":
                    lane.error = record.get("error")
                    break
                if record.get("type") == "process-exit":
                    lane.error = f"the engine process ended while loading (exit {record.get('code')})"
                    break
            self.on_update(self, lane)
        failed = [lane for lane in self.lanes if lane.error]
        if failed:
            raise CompareError(f"{failed[0].strategy}: {failed[0].error}")

    def pause(self, paused: bool) -> None:
        """Hold the lockstep before its next round of forwards (every engine keeps its cache), or go on."""
        if paused:
            self.going.clear()
        else:
            self.going.set()

    def stop(self) -> None:
        """End every engine (their traces are kept); a second call returns at once."""
        if self.stopped:
            return
        self.stopped = True
        self.going.set()
        started = [lane.source for lane in self.lanes if lane.source is not None]
        for source in started:  # every engine told first: they wind down side by side
            source.command("quit")
        for source in started:
            source.stop()

    # ---- lockstep ---------------------------------------------------------------------------------------

    def run(self, turns) -> None:
        self.turns_total = len(turns)
        for number, text in enumerate(turns, start=1):
            self.turn = number
            for lane in self.lanes:
                lane.turns.append([])
                lane.reply = []
                self._do(lane, "send", {"text": text, "run": False})
            while not self.stopped and any(not lane.turn_done and not lane.error for lane in self.lanes):
                self.going.wait()
                if self.stopped:
                    return
                for lane in self.lanes:  # one forward each, in turn: never two engines computing at once
                    if not lane.turn_done and not lane.error:
                        self._do(lane, "step")
            if self.stopped:
                return
            for lane in self.lanes:  # what the press cost this turn: one uncompressed recompute (verify)
                if lane.press and not lane.error:
                    self._do(lane, "verify")

    def _do(self, lane: Lane, word: str, argument=None) -> None:
        lane.source.command(word, argument)
        for record in lane.records:
            kind = record.get("type")
            if kind == "step":
                self._step(lane, record)
                self.on_update(self, lane)
            elif kind == "state" and record.get("done") == word:
                verify = record.get("verify") or {}
                if verify.get("compressed_kl") is not None:
                    lane.costs.append((float(verify["compressed_kl"]), bool(verify.get("compressed_top1"))))
                if record.get("error") or record.get("severity") == "error":
                    lane.error = record.get("error") or record.get("note")
                    self.on_update(self, lane)
                return
            elif kind == "process-exit":
                lane.error = f"the engine process ended (exit {record.get('code')})"
                self.on_update(self, lane)
                return

    def _step(self, lane: Lane, record: dict) -> None:
        fed = len(record["input_ids"])
        length = record.get("buffer_length", 0)
        compile_ms = (record.get("compile") or {}).get("compile_ms")
        lane.points.append(
            Point(
                context=length,
                ms=(record.get("ms") or {}).get("forward", 0.0),
                phase=record.get("phase", "decode"),
                compile=compile_ms is not None,
            )
        )
        if compile_ms is not None:
            lane.compile_ms += compile_ms
        lane.recompiles = (record.get("compile") or {}).get("recompiles", lane.recompiles)
        chosen = (record.get("chosen") or {}).get("id")
        lane.chosen.append(chosen)
        if record.get("phase") == "decode" and lane.turns:
            lane.turns[-1].extend(record["input_ids"][-fed:])
            learn_bytes(record.get("bytes"), lane.token_bytes)
            lane.reply.extend(
                token_bytes(t.get("id", -1), t.get("piece", ""), lane.token_bytes) for t in record.get("fed") or []
            )
        lane.turn_done = bool(record.get("turn_done"))
        lane.cache_bytes = sum(layer.get("bytes", 0) for layer in record.get("layers") or [])
        lane.cache_length = record.get("cache_seq_length", 0)
        lane.held = max((layer.get("filled", 0) for layer in record.get("layers") or []), default=0)
        lane.context = length

    # ---- verdicts ---------------------------------------------------------------------------------------

    def first_difference(self, final: bool = True) -> int | None:
        """The first step (1-based) whose chosen token differs between any two lanes, or None. While the lanes
        run (`final=False`) one may be a step ahead of another in the round: only the steps all made count."""
        if len(self.lanes) < 2:
            return None
        length = min(len(lane.chosen) for lane in self.lanes)
        for index in range(length):
            if len({lane.chosen[index] for lane in self.lanes}) > 1:
                return index + 1
        if final and len({len(lane.chosen) for lane in self.lanes}) > 1:
            return length + 1
        return None

    @property
    def identical(self) -> bool:
        return self.first_difference() is None and not any(lane.error for lane in self.lanes)
