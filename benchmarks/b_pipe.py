"""Bytes on the engine -> app pipe per decode step, early and late in a long chat.

The engine process sends, per decode step, a `session` record (the chat and the alarms, as what changed)
and the step record (engine/records/stream.py). A chat of many turns runs through the real engine process
(EngineSource, as the app starts it); each decode step's records are re-serialised here as the pipe
carries them (one JSON line each) and summed. The claim: a decode step's bytes do not grow with the chat.

    python benchmarks/b_pipe.py [--turns 12] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench(model_dir: str, turns: int = 12, tokens: int = 24) -> dict:
    from kvtui.engine.chat.host import EngineSetup, EngineSource
    from kvtui.options import AppConfig

    options = AppConfig(options={"max_new_tokens": tokens}).options
    source = EngineSource(EngineSetup(model=model_dir, options=options, trace_path=None))
    records = source.records()
    steps: list[dict] = []  # per decode step: its chat length in tokens, the bytes of its records
    pending = 0

    def until(word: str) -> None:
        nonlocal pending
        for record in records:
            size = len(json.dumps(record, ensure_ascii=False)) + 1
            kind = record.get("type")
            if kind == "session":
                pending = size
            elif kind == "step":
                if record.get("phase") == "decode":
                    steps.append({"cache": record.get("buffer_length", 0), "bytes": pending + size})
                pending = 0
            elif kind == "state" and record.get("done") == word:
                return
            elif kind in ("load-failed", "process-exit"):
                raise RuntimeError(f"the engine stopped: {record}")

    for record in records:  # loaded
        if record.get("type") == "ready":
            break
        if record.get("type") == "load-failed":
            raise RuntimeError(record["error"])
    for turn in range(turns):
        source.command("send", {"text": f"Tell me more, turn {turn}: " + "words " * 20, "run": True})
        until("send")
    source.stop()
    window = max(1, len(steps) // 10)
    first, last = steps[:window], steps[-window:]
    return {
        "turns": turns,
        "tokens_per_turn": tokens,
        "decode_steps": len(steps),
        "first": _window(first),
        "last": _window(last),
    }


def _window(steps: list[dict]) -> dict:
    """Mean and max: the chat rides on a few steps a second (MESSAGES_HZ), which a median would hide."""
    sizes = [s["bytes"] for s in steps]
    return {"cache": steps[-1]["cache"], "bytes": sum(sizes) / len(sizes), "max": max(sizes)}


def describe(r: dict) -> str:
    first, last = r["first"], r["last"]
    return (
        f"{r['decode_steps']} decode steps over {r['turns']} turns: bytes per decode step (mean, max) "
        f"{first['bytes']:.0f}, {first['max']} in the first tenth (cache up to {first['cache']} tokens) and "
        f"{last['bytes']:.0f}, {last['max']} in the last tenth (cache up to {last['cache']} tokens): "
        f"mean ratio {last['bytes'] / first['bytes']:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    from kvtui.engine.models.tiny import build_tiny

    with tempfile.TemporaryDirectory(prefix="kvtui-pipe-model-") as tmp:
        model = build_tiny("llama", Path(tmp) / "tiny-llama")
        print(describe(bench(str(model), args.turns, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
