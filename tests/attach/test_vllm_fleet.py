"""`kvtui attach URL1 URL2` on two real vLLM servers (a fleet of two replicas, conftest's `vllm_fleet`): a system
prompt prefilled on the second while the first held it is named `held-elsewhere` with the first's address; a
prefix cleared (POST /reset_prefix_cache) and asked again is named `evicted-prefix` with its age; a prompt never
seen raises nothing; the answers are the same attached and not, and both servers serve on after the viewer quits."""

from __future__ import annotations

import re
import urllib.request

import pytest
from test_vllm_attach import SYSTEM, finish

from kvtui.engine.server.server_trace import load_server_trace

pytestmark = pytest.mark.xdist_group("vllm")


def test_the_fleet_names_the_replica_that_held_the_prefix_and_the_eviction(vllm_fleet, tmp_path):
    first, second = vllm_fleet
    question = "Can I rent a bike for a day?"
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
    elsewhere = [line for line in out.splitlines() if line.startswith("kvtui: warning held-elsewhere")]
    assert len(elsewhere) == 1, out
    assert f"were prefilled on {second_name} while {first_name} held them" in elsewhere[0]
    held = int(re.search(r"held-elsewhere: (\d+) tokens from token 0", elsewhere[0]).group(1))
    assert held >= 96  # the system prompt's full blocks of 32 (about 130 tokens), at least
    evicted = [line for line in out.splitlines() if line.startswith("kvtui: info evicted-prefix")]
    assert len(evicted) == 1 and "removed when the cache was cleared" in evicted[0], out
    assert re.search(r"cleared \d+\.\d s before, \d+\.\d s after being stored", evicted[0])
    # nothing else: the first prompt on the first server was never seen before, and the notes say no more
    assert not [line for line in out.splitlines() if re.match(r"kvtui: (warning|info|error) ", line)][2:], out
    assert f"{second_name}: fleet: {held} tokens prefilled here while another replica held them" in out

    run = load_server_trace(trace)
    assert [n.code for n in run.cache.notes] == ["held-elsewhere", "evicted-prefix"]
    assert run.cache.stats(second_name).routed_tokens == held
    # both serve on after the viewer quit, the same answers
    assert first.chat("You are a terse assistant.", "Say hello.", max_tokens=8) == plain
    assert second.chat(SYSTEM, question, max_tokens=8) == on_second
