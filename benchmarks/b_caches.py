"""3. Why caches exist: the 8-turn seed conversation with incremental cached turns (ChatSession) vs a
naive loop that re-encodes the whole history for every generated token (no cache), same greedy
tokens; and dynamic vs static cache on the same conversation."""

from __future__ import annotations

import time

import torch

from common import SEED_TURNS, in_worker, log, summary
from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.engine.reading import introspect


def run_cached(model, tokenizer, max_new: int, cache: str = "dynamic", max_cache_len: int | None = None) -> dict:
    """Every turn: send (prefill only the new suffix) + generate. Records each forward's buffer length and
    chosen token so the naive loop can recompute exactly the same logits."""
    config = SessionConfig(cache=cache, max_cache_len=max_cache_len, max_new_tokens=max_new)
    session = ChatSession(model, tokenizer, config)
    turns = []
    for text in SEED_TURNS:
        forwards = []

        def keep(snapshot, forwards=forwards):
            forwards.append((len(snapshot.buffer), snapshot.chosen.id if snapshot.chosen else None))

        session.on_snapshot.add(keep)
        t0 = time.perf_counter()
        first = session.send(text)
        session.generate()
        dt = time.perf_counter() - t0
        session.on_snapshot.remove(keep)
        turns.append(
            {
                "seconds": dt,
                "prefill_tokens": len(first.input_ids),
                "forwards": forwards,
                "generated": len(forwards),
                "cache_length": session.cache_length,
            }
        )
    return {
        "turns": turns,
        "ids": [t.id for t in session.buffer],
        "total_s": sum(t["seconds"] for t in turns),
        "final_length": session.cache_length,
        "capacity": session.capacity,
        "cache_bytes": session.last.cache_bytes if session.last else 0,
    }


def run_naive(model, cached: dict, deadline: float | None = None) -> dict:
    """No cache: for every token the cached run chose, one forward over the whole history so far
    (exactly the tokens the cache held at that forward), argmax of the last row. Turns that would start
    after `deadline` (perf_counter) are skipped and reported as such."""
    ids = cached["ids"]
    keep = {"logits_to_keep": 1} if introspect.forward_accepts(model, "logits_to_keep") else {}
    turns, agree = [], True
    with torch.inference_mode():
        for i, turn in enumerate(cached["turns"]):
            if deadline is not None and time.perf_counter() > deadline:
                log(f"  naive: time budget reached, skipping turns {i + 1}-{len(cached['turns'])}")
                break
            t0 = time.perf_counter()
            processed = 0
            for length, chosen in turn["forwards"]:
                out = model(
                    input_ids=torch.tensor([ids[:length]]),
                    use_cache=False,
                    position_ids=torch.arange(length).unsqueeze(0),
                    **keep,
                )
                processed += length
                agree &= int(torch.argmax(out.logits[0, -1])) == chosen
            turns.append({"seconds": time.perf_counter() - t0, "tokens_processed": processed})
            log(f"  naive turn {i + 1}: {turns[-1]['seconds']:.1f} s ({processed:,} tokens re-encoded)")
    return {
        "turns": turns,
        "total_s": sum(t["seconds"] for t in turns),
        "agree": agree,
        "complete": len(turns) == len(cached["turns"]),
    }


def bench_cached(
    model,
    tokenizer,
    max_new: int,
    cached_repeats: int,
    static_repeats: int,
    static_len: int = 2048,
    deadline: float | None = None,
) -> dict:
    """Dynamic and static sessions on the seed chat, interleaved per round."""
    dyn, sta = [], []
    in_worker(run_cached, model, tokenizer, 4)  # warm-up (short); every run in a fresh thread, like the TUI
    for r in range(max(cached_repeats, static_repeats)):
        if r < cached_repeats:
            dyn.append(in_worker(run_cached, model, tokenizer, max_new))
            log(f"  caches round {r + 1}: dynamic {dyn[-1]['total_s']:.2f} s, {dyn[-1]['final_length']} tokens")
        if r < static_repeats:
            if r > 0 and deadline is not None and time.perf_counter() > deadline:
                log("  caches: skipping further static repeats (time budget)")
            else:
                sta.append(in_worker(run_cached, model, tokenizer, max_new, "static", static_len))
                log(f"  caches round {r + 1}: static({static_len}) {sta[-1]['total_s']:.2f} s")
    return {"max_new": max_new, "static_len": static_len, "dynamic": dyn, "static": sta}


def combine(cached: dict, naive: list[dict]) -> dict:
    dyn, sta = cached["dynamic"], cached["static"]
    ref = dyn[0]
    per_turn = []
    for i, turn in enumerate(ref["turns"]):
        d = summary([run["turns"][i]["seconds"] for run in dyn])
        s = summary([run["turns"][i]["seconds"] for run in sta])
        n = summary([run["turns"][i]["seconds"] for run in naive if i < len(run["turns"])])
        per_turn.append(
            {
                "turn": i + 1,
                "prefill_tokens": turn["prefill_tokens"],
                "generated": turn["generated"],
                "cache_length": turn["cache_length"],
                "dynamic_s": d,
                "static_s": s,
                "naive_s": n,
                "naive_tokens_processed": naive[0]["turns"][i]["tokens_processed"]
                if naive and i < len(naive[0]["turns"])
                else 0,
                "speedup_naive_over_dynamic": n["median"] / d["median"] if n["n"] else float("nan"),
                "static_over_dynamic": s["median"] / d["median"] if sta else float("nan"),
            }
        )
    complete = [run for run in naive if run["complete"]]
    total_d = summary([run["total_s"] for run in dyn])
    total_s = summary([run["total_s"] for run in sta])
    total_n = summary([run["total_s"] for run in complete])
    done = len(naive[0]["turns"]) if naive else 0
    # over the turns the naive loop finished (all 8 unless the time budget cut it)
    partial_d = sum(t["dynamic_s"]["median"] for t in per_turn[:done])
    partial_n = sum(t["naive_s"]["median"] for t in per_turn[:done])
    return {
        "max_new": cached["max_new"],
        "static_len": cached["static_len"],
        "per_turn": per_turn,
        "total": {
            "dynamic_s": total_d,
            "static_s": total_s,
            "naive_s": total_n,
            "speedup": total_n["median"] / total_d["median"] if complete else float("nan"),
            "speedup_over_done_turns": partial_n / partial_d if done else float("nan"),
            "naive_turns_done": done,
            "static_over_dynamic": total_s["median"] / total_d["median"] if sta else float("nan"),
        },
        "final_length": ref["final_length"],
        "generated_total": sum(t["generated"] for t in ref["turns"]),
        "naive_agree": all(n["agree"] for n in naive) if naive else None,
        "naive_runs": len(naive),
        "dynamic_runs": len(dyn),
        "static_runs": len(sta),
        "static_same_tokens": all(s["ids"] == ref["ids"] for s in sta),
        "dynamic_repeat_same_tokens": all(d["ids"] == ref["ids"] for d in dyn),
        "dynamic_cache_bytes": ref["cache_bytes"],
        "static_cache_bytes": sta[0]["cache_bytes"] if sta else 0,
    }
