"""`kvtui attach URL1 URL2` on two real vLLM servers (a fleet of two replicas, conftest's `vllm_fleet`): a system
prompt prefilled on the second while the first held it is named `held-elsewhere` with the first's address; a
prefix cleared (POST /reset_prefix_cache) and asked again is named `evicted-prefix` with its age; a prompt never
seen raises nothing; the answers are the same attached and not, and both servers serve on after the viewer quits.
The servers are the session's (conftest.py): what the tests before sent them is cleared first and caught up on
attach (its notes, if any, say "caught up"; only the live ones are this test's), its prompts are its own."""

from __future__ import annotations

import re
import urllib.request

import pytest
from test_vllm_attach import finish

from kvtui.engine.server.prefix_cache import CAUGHT_UP
from kvtui.engine.server.server_trace import load_server_trace
from kvtui.engine.server.view import stats_view

pytestmark = pytest.mark.xdist_group("vllm")
SYSTEM = (  # no other test sends it: nothing of it was ever cached on these servers
    "You are the patient assistant of a ferry company on a northern lake. You answer questions about timetables, "
    "tickets, bicycles on board, cars, pets and the weather. Keep answers short, friendly and exact. The first "
    "ferry leaves at six in the morning and the last at ten at night; in winter the ferry runs every two hours. "
    "Bicycles travel free, cars need a ticket bought before boarding, and dogs must stay on a lead on deck. If the "
    "wind is too strong the ferry waits in port, and the website says so. If you do not know, say so plainly."
)


def live(lines: list[str]) -> list[str]:
    """kvtui's note lines (warning, info, error) about what happened since it attached."""
    notes = [line for line in lines if re.match(r"kvtui: (warning|info|error) ", line)]
    return [line for line in notes if CAUGHT_UP not in line]


def test_the_fleet_names_the_replica_that_held_the_prefix_and_the_eviction(vllm_fleet, tmp_path):
    first, second = vllm_fleet
    for server in vllm_fleet:
        server.clear_prefix_cache()
    question = "Can I take my bike on the first ferry?"
    plain = first.chat("You are a terse assistant.", "Say hello.", max_tokens=8)  # before kvtui: never seen again
    trace = tmp_path / "fleet.jsonl"
    viewer = first.attach("--trace", str(trace), fleet=(second,))
    on_first = first.chat(SYSTEM, question, max_tokens=8)
    on_second = second.chat(SYSTEM, question, max_tokens=8)  # routed to the replica without the prefix
    request = urllib.request.Request(f"{first.url}/reset_prefix_cache", data=b"", method="POST")
    urllib.request.urlopen(request, timeout=30).read()
    again = first.chat(SYSTEM, question, max_tokens=8)  # the cleared prefix asked again
    out, _ = finish(viewer)
    assert on_first == on_second == again

    first_name, second_name = (s.url.removeprefix("http://") for s in vllm_fleet)
    notes = live(out.splitlines())
    elsewhere = [line for line in notes if line.startswith("kvtui: warning held-elsewhere")]
    assert len(elsewhere) == 1, out
    assert f"were prefilled on {second_name} while {first_name} held them" in elsewhere[0]
    held = int(re.search(r"held-elsewhere: (\d+) tokens from token 0", elsewhere[0]).group(1))
    assert held >= 96  # the system prompt's full blocks of 32 (about 130 tokens), at least
    evicted = [line for line in notes if line.startswith("kvtui: info evicted-prefix")]
    assert len(evicted) == 1 and "removed when the cache was cleared" in evicted[0], out
    assert re.search(r"cleared \d+\.\d s before, \d+\.\d s after being stored", evicted[0])
    # nothing else: the first prompt on the first server was never seen before, and the notes say no more
    assert len(notes) == 2, out
    assert f"{second_name}: fleet: {held} tokens prefilled here while another replica held them" in out

    run = load_server_trace(trace)
    codes = [n.code for n in run.cache.notes if not n.message.startswith(CAUGHT_UP)]
    assert codes == ["held-elsewhere", "evicted-prefix"]
    assert run.cache.stats(second_name).routed_tokens == held
    # the fleet over time ends where the index is: the waste on the second, and the tokens held on both as counted
    # here from the blocks held, by their tokens from the prompt's start (walked up their parents)
    # (the first prefilled again after its clear what the second held: routing waste there too, though the note
    # names the eviction, the first cause that holds)
    fleet = stats_view(run.cache).fleet
    routed_first = run.cache.stats(first_name).routed_tokens
    assert dict(fleet[-1].routed) == {first_name: routed_first, second_name: held} and routed_first >= 96
    assert f"{first_name}: fleet: {routed_first} tokens prefilled here while another replica held them" in out
    for name in (first_name, second_name):  # a running total: it never goes down, and ends where the index is
        series = [dict(sample.routed).get(name, 0) for sample in fleet]
        assert series == sorted(series) and series[-1] == run.cache.stats(name).routed_tokens, (name, fleet)
    held_by: dict[tuple, set[str]] = {}
    entries = []
    for block in run.cache.blocks.values():
        tokens, node, root = [], block, block
        while node is not None:
            tokens[:0], root, node = list(node.tokens), node, node.parent
        if root.orphan:  # its start came before kvtui attached: unknown, counted nowhere
            continue
        held_by.setdefault(tuple(tokens), set()).add(block.origin)
        entries.append((block.origin, tuple(tokens), len(block.tokens)))
    twice = {first_name: 0, second_name: 0}
    for origin, prefix, size in entries:
        twice[origin] += size if len(held_by[prefix]) > 1 else 0
    assert dict(fleet[-1].twice) == twice and twice[second_name] >= held, twice
    # both serve on after the viewer quit, the same answers
    assert first.chat("You are a terse assistant.", "Say hello.", max_tokens=8) == plain
    assert second.chat(SYSTEM, question, max_tokens=8) == on_second
