"""Trace parity: the traces a watched program writes, from two checkouts of kvtui, compared line by line.

`python benchmarks/trace_parity.py write OUT_DIR` writes six traces with the kvtui on PYTHONPATH (a greedy loop
watched with top-k 10 and with top-k 5, a loop whose cache is edited in place between two forwards, a left-padded
batch of 2, and that loop and that batch again with attention capture on); `python benchmarks/trace_parity.py
compare BEFORE_SRC [AFTER_SRC]` runs `write` under each checkout (AFTER_SRC defaults to this one) and says whether
every line is the same, apart from the `ms` timings and the temporary paths. A change to the watched step's code
that should not change what it records is checked with it (e.g. against main: `compare /work/main`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = 12
PROMPT = "Explain step by step how a KV cache speeds up text generation."


def _model(tmp: Path):
    from kvtui.engine.chat.loader import load_model
    from kvtui.engine.models.tiny import build_tiny

    loaded = load_model(str(build_tiny("llama", tmp / "tiny-llama", layers=3)), dtype="float32", device="cpu")
    return loaded.model, loaded.tokenizer


def _greedy(model, tokenizer, edit_at: int | None = None) -> None:
    import torch
    from transformers import DynamicCache

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]  # [1, n]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for step in range(STEPS):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            if step == edit_at:  # an in-place edit between two forwards: kvtui names it at the next one
                cache.layers[1].keys[0, 0, 0, 0] += 1.0


def _batch(model, tokenizer) -> None:
    import torch
    from transformers import DynamicCache

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(["Hello there, how are you today?", "Hi"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]  # [2, n] each
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for _ in range(STEPS):
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [2, 1]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)


def write(out: Path) -> None:
    import torch

    import kvtui

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _model(out)  # under OUT: its path is the root the comparison replaces
    with kvtui.watch(model, tokenizer, trace=out / "topk10.jsonl", top_k=10):
        _greedy(model, tokenizer)
    with kvtui.watch(model, tokenizer, trace=out / "topk5.jsonl", top_k=5):
        _greedy(model, tokenizer)
    with kvtui.watch(model, tokenizer, trace=out / "edit.jsonl"):
        _greedy(model, tokenizer, edit_at=4)
    with kvtui.watch(model, tokenizer, trace=out / "batch.jsonl"):
        _batch(model, tokenizer)
    with kvtui.watch(model, tokenizer, trace=out / "attention.jsonl", attention=True):  # the regions' shares too
        _greedy(model, tokenizer)
    with kvtui.watch(model, tokenizer, trace=out / "attention-batch.jsonl", attention=True):  # pads among them
        _batch(model, tokenizer)


def _normal(value, roots: tuple[str, ...]):
    """A record without its timings (`ms`, `*_ms`) and with temporary paths replaced."""
    if isinstance(value, dict):
        return {k: _normal(v, roots) for k, v in value.items() if k != "ms" and not k.endswith("_ms")}
    if isinstance(value, list):
        return [_normal(v, roots) for v in value]
    if isinstance(value, str):
        for root in roots:
            value = value.replace(root, "<tmp>")
    return value


def _lines(path: Path, root: Path) -> list:
    roots = (str(root), tempfile.gettempdir())
    return [_normal(json.loads(line), roots) for line in path.read_text().splitlines()]


def compare(before_src: str, after_src: str) -> int:
    with tempfile.TemporaryDirectory(prefix="kvtui-parity-cmp-") as tmp:
        dirs = {}
        for name, src in (("before", before_src), ("after", after_src)):
            dirs[name] = Path(tmp) / name
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            subprocess.run([sys.executable, __file__, "write", str(dirs[name])], check=True, env=env)
        failed = 0
        for trace in sorted(p.name for p in dirs["before"].glob("*.jsonl")):
            a, b = _lines(dirs["before"] / trace, dirs["before"]), _lines(dirs["after"] / trace, dirs["after"])
            steps = sum(1 for r in a if r.get("type") == "step")
            codes = sorted({d["code"] for r in a for d in r.get("diagnostics", ())})
            if a == b:
                print(f"{trace}: {len(a)} lines the same ({steps} steps; alarms {codes})")
                continue
            failed += 1
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"{trace}: DIFFERS at line {first + 1} ({len(a)} lines before, {len(b)} after)")
            if first < min(len(a), len(b)):
                print("  before:", json.dumps(a[first])[:600])
                print("  after: ", json.dumps(b[first])[:600])
        return failed


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "compare":
        here = str(Path(__file__).resolve().parent.parent)
        raise SystemExit(1 if compare(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else here) else 0)
    else:
        raise SystemExit(__doc__)
