"""2. Scale: snapshot + diagnostics cost per step at growing cache lengths (must stay flat), the cost of
`introspect.layer_infos(cache)` alone, per-step app-side costs, and memory during a step vs the cache."""

from __future__ import annotations

import json
import time
from pathlib import Path

from common import log, rss_bytes, summary
from kvtui.engine.chat.loader import load_model
from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.engine.models.tiny import CORPUS, build_tiny
from kvtui.engine.reading import introspect
from kvtui.engine.records.codec import to_record

MAX_POSITIONS = 65536
CHUNK_TOKENS = 2048  # prefill chunk: keeps the attention scores of one forward small


MEMORY_STEPS = 10
SWEEP_BYTES = 48 * 2**20  # more than this VM's last-level cache share and the longest row's K/V concatenation
WORK_STEPS = 5
DEFAULT_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def _mmap_threshold(value: int) -> bool:
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, value))
    except (OSError, AttributeError):
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _rss_kib() -> int:
    return _status_kib("VmRSS:")


def _peak_kib() -> int:
    return _status_kib("VmHWM:")


def _reset_peak() -> int:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0) and return it (KiB).
    With a small mmap threshold (mallopt)  torch's large buffers are mmap'ed and unmapped on free:
    then the high-water mark of one step is what that step allocated at its peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_kib()


def build_long_tiny(out_dir: Path) -> Path:
    """build_tiny('llama') (real tokenizer, chat template), then raise max_position_embeddings so
    positions up to 32k+ are inside the model's declared range (Llama RoPE is computed on the fly)."""
    path = build_tiny("llama", out_dir)
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = MAX_POSITIONS
    config_path.write_text(json.dumps(config, indent=2))
    return Path(path)


class _Filler:
    """Texts of an exact token count for completion-mode sends (no special tokens after the first)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        words = " ".join(CORPUS).split()
        self.full = " " + " ".join((words * (1 + 12000 // len(words)))[:12000])
        enc = tokenizer(self.full, add_special_tokens=False, return_offsets_mapping=True)
        self.ends = [end for _, end in enc["offset_mapping"]]

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text(self, tokens: int) -> tuple[str, int]:
        """A prefix of the long text with at most `tokens` tokens (cut at a token end), and its count."""
        cut = min(tokens, len(self.ends))
        while cut > 0:
            text = self.full[: self.ends[cut - 1]]
            n = self.count(text)
            if n <= tokens:
                return text, n
            cut -= 1
        return self.full[:1], self.count(self.full[:1])


def _grow_to(session: ChatSession, filler: _Filler, target: int) -> None:
    while session.cache_length < target:
        need = target - session.cache_length
        if need <= 3:
            session.step()
            continue
        text, _ = filler.text(min(need, CHUNK_TOKENS))
        session.send(text)


class _Sweep:
    """A forward hook (the benchmark's, not kvtui's) that, when on, writes SWEEP_BYTES after each forward: the CPU
    caches then hold the same (nothing of kvtui's) after a short forward as after a long one, whose attention and
    `torch.cat` of every layer's K/V evict them. kvtui's snapshot timed after it is its own work at equal cache
    state; without it, the same fixed ops run slower after a longer forward."""

    def __init__(self, model):
        import torch

        self.on = False
        self._buffer = torch.zeros(SWEEP_BYTES // 4)
        self._handle = model.register_forward_hook(self._after)

    def _after(self, module, args, output) -> None:
        if self.on:
            self._buffer.add_(1.0)

    def remove(self) -> None:
        self._handle.remove()


def _work(session: ChatSession, steps: int) -> dict:
    """kvtui's work per decode step, counted: lines of its Python (b_work.LineCounter) and the tensor ops it issues
    with the elements they read (views excluded): what would grow if kvtui did O(cache) work."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import b_work

    class Elements(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and b_work._from_kvtui(2):
                self.ops += 1
                self.elements += sum(a.numel() for a in args if hasattr(a, "numel"))
            return func(*args, **(kwargs or {}))

    lines = b_work.LineCounter()
    with Elements() as ops:
        lines.start()
        try:
            for _ in range(steps):
                session.step()
        finally:
            lines.stop()
    return {"lines": lines.lines / steps, "ops": ops.ops / steps, "elements": ops.elements / steps}


def bench(tiny_dir: Path, lengths: list[int], steps: int = 40, info_calls: int = 200) -> dict:
    loaded = load_model(str(tiny_dir), dtype="float32", device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    session = ChatSession(model, tokenizer, SessionConfig(mode="completion", max_new_tokens=10**9))
    session.stop_ids = frozenset()  # never stop at EOS: this only measures cost per step
    filler = _Filler(tokenizer)
    session.send(filler.text(8)[0])
    sweep = _Sweep(model)
    rows = []
    for target in lengths:
        t0 = time.perf_counter()
        _grow_to(session, filler, target)
        fill_s = time.perf_counter() - t0
        cache = session.cache
        # warm-up step at this length
        session.step()
        snaps, walls = [], []
        for _ in range(steps):
            t = time.perf_counter()
            snaps.append(session.step())
            walls.append((time.perf_counter() - t) * 1000)
        # the same steps with the CPU caches swept after every forward, interleaved with plain ones (5 rounds)
        plain_ms, swept_ms = [], []
        for _ in range(5):
            for on, into in ((False, plain_ms), (True, swept_ms)):
                sweep.on = on
                into += [session.step().snapshot_ms for _ in range(max(4, steps // 5))]
        sweep.on = False
        work = _work(session, WORK_STEPS)
        # memory: a few more steps with every allocation >= 64 KiB mmap'ed (freed = unmapped), so the
        # kernel's high-water mark, reset before each step, is the step's own peak allocation
        peaks = []
        _mmap_threshold(64 * 1024)
        rss_before = _rss_kib() * 1024
        for _ in range(MEMORY_STEPS):
            before = _reset_peak()
            session.step()
            peaks.append((_peak_kib() - before) * 1024)
        rss_after = _rss_kib() * 1024
        _mmap_threshold(DEFAULT_MMAP_THRESHOLD)
        infos_us = []
        window = introspect.config_window(model.config)
        for _ in range(info_calls):
            t = time.perf_counter()
            introspect.layer_infos(cache, window)
            infos_us.append((time.perf_counter() - t) * 1e6)
        # per-step costs the TUI adds in the engine thread
        last = snaps[-1]
        record_us = []
        for _ in range(50):
            t = time.perf_counter()
            json.dumps(to_record(last))
            record_us.append((time.perf_counter() - t) * 1e6)
        # session.messages decodes the whole current reply (the TUI calls it after every step):
        # time it for a reply as long as the cache, i.e. one long generated turn
        ids = [t.id for t in session.buffer]
        decode_ms = []
        for _ in range(5):
            t = time.perf_counter()
            tokenizer.decode([tok.id for tok in session.buffer], skip_special_tokens=True)
            decode_ms.append((time.perf_counter() - t) * 1000)
        cache_bytes = last.cache_bytes
        rows.append(
            {
                "target": target,
                "length_first": snaps[0].cache_seq_length,
                "length_last": last.cache_seq_length,
                "fill_s": fill_s,
                "steps": steps,
                "snapshot_ms": summary([s.snapshot_ms for s in snaps]),
                "snapshot_plain_ms": summary(plain_ms),
                "snapshot_swept_ms": summary(swept_ms),
                "work": work,
                "forward_ms": summary([s.forward_ms for s in snaps]),
                "step_wall_ms": summary(walls),
                "overhead_ms": summary([w - s.forward_ms for w, s in zip(walls, snaps)]),
                "layer_infos_us": summary(infos_us),
                "to_record_json_us": summary(record_us),
                "reply_decode_ms": summary(decode_ms),
                "cache_bytes": cache_bytes,
                "rss_before": rss_before,
                "step_peak_bytes": summary(peaks),
                "rss_growth": rss_after - rss_before,
                "layers": len(last.layers),
                "tokens_ids": len(ids),
            }
        )
        log(
            f"  scale {last.cache_seq_length} tokens: snapshot {rows[-1]['snapshot_ms']['median']:.3f} ms "
            f"(interleaved: plain {rows[-1]['snapshot_plain_ms']['median']:.3f}, after a cache sweep "
            f"{rows[-1]['snapshot_swept_ms']['median']:.3f}; {work['lines']:.0f} kvtui lines, {work['ops']:.1f} ops "
            f"reading {work['elements']:.0f} elements per step), "
            f"layer_infos {rows[-1]['layer_infos_us']['median']:.1f} "
            f"us, forward {rows[-1]['forward_ms']['median']:.2f} ms, "
            f"cache {cache_bytes / 2**20:.2f} MiB, step peak +{max(peaks) / 2**20:.2f} MiB (fill {fill_s:.1f} s)"
        )
    sweep.remove()
    return {
        "model": f"tiny llama ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
        f"{model.config.num_key_value_heads} KV heads x {model.config.hidden_size // model.config.num_attention_heads}"
        f" head dim, max positions {model.config.max_position_embeddings})",
        "rss_end": rss_bytes(),
        "rows": rows,
    }


if __name__ == "__main__":  # run in a child process (see run.py): its memory is its own
    import argparse
    import tempfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="128,1024,8192,32768")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="kvtui-bench-") as tmp:
        result = bench(build_long_tiny(Path(tmp)), [int(x) for x in args.lengths.split(",")], steps=args.steps)
    Path(args.out).write_text(json.dumps(result))
