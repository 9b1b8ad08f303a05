"""What the suite would otherwise build on first use, built by `make test` while the other environments install
(the suite's CPU is its limit; an install waits on the network): quanto's C++ kernels (compiled into the
environment at the first quantized cache on the CPU, ~150 s of CPU here) and the embedded SmolLM2 converted with
this environment's transformers into the directory the tests use (conftest.py names it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import conftest  # noqa: E402,F401  (KVTUI_CACHE_DIR as the tests set it)

# isort: split
from optimum.quanto.library.extensions import get_extension  # noqa: E402

from kvtui.engine.models.embedded import embedded_model_dir  # noqa: E402

get_extension("quanto_cpp").lib  # noqa: B018  (the property builds or loads the extension)
print(f"prepared: quanto's kernels, the embedded model in {embedded_model_dir()}")
