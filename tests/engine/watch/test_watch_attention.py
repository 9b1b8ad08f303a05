"""`kvtui watch --attention`: the primed-pads sample's pads seen attended (attended-pads, with their share and
positions), the correct loop raising nothing from its attention, and the trace holding every layer's rows."""

import json
import re
import subprocess
import sys
from pathlib import Path

from program_headers import model_dir

ROOT = Path(__file__).resolve().parents[3]
PROGRAMS = ROOT / "samples" / "programs"


def watch(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--attention", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def test_primed_pads_raise_attended_pads_with_their_share(tmp_path, plain_python):
    trace = tmp_path / "primed.jsonl"
    plain = plain_python.run([PROGRAMS / "primed_pads.py", model_dir("embedded")], cwd=ROOT)
    result = watch("--trace", trace, PROGRAMS / "primed_pads.py", model_dir("embedded"))
    assert result.stdout == plain.stdout  # the program prints exactly what it prints unwatched
    line = next(line for line in result.stderr.splitlines() if "attended-pads" in line)
    share = re.search(r"puts (\d+)% of its attention", line)
    assert share and int(share.group(1)) >= 1 and "positions 0–31" in line, line
    steps = [json.loads(r) for r in trace.read_text().splitlines() if json.loads(r)["type"] == "step"]
    alarmed = next(s for s in steps if any(d["code"] == "attended-pads" for d in s["diagnostics"]))
    attention = alarmed["attention"]
    assert len(attention["layers"]) == 30 and all(layer for layer in attention["layers"])
    pads = attention["regions"].index("pad")
    mean = sum(row[pads] for row in attention["shares"]) / 30
    assert f"{mean:.0%}" == f"{int(share.group(1))}%"


def test_correct_loop_raises_nothing_from_attention():
    result = watch(PROGRAMS / "correct_loop.py", model_dir("embedded"))
    assert result.returncode == 0, result.stderr
    assert "attended-pads" not in result.stderr
