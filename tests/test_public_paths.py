"""The import paths the README, the samples and the notebook name keep working whatever the engine's layout."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (module, name) pairs users are told to import
DOCUMENTED = [
    ("kvtui", "watch"),
    ("kvtui", "replay"),
    ("kvtui.engine.export", "load_cache"),
    ("kvtui.engine.export", "export_cache"),
    ("kvtui.engine.models.tiny", "build_tiny"),
    ("kvtui.engine", "ChatSession"),
    ("kvtui.engine", "SessionConfig"),
    ("kvtui.engine", "StepSnapshot"),
    ("kvtui.engine", "SamplerSettings"),
]


@pytest.mark.parametrize(("module", "name"), DOCUMENTED)
def test_documented_names_import(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_the_export_path_is_the_reading_module():
    from kvtui.engine.export import load_cache
    from kvtui.engine.reading import export

    assert load_cache is export.load_cache


def _named_modules(text: str) -> set[str]:
    """Every `kvtui.x.y` module path a text names in an import, a `-m` or a dotted reference."""
    found = set(re.findall(r"\bfrom (kvtui(?:\.\w+)*) import", text))
    found |= set(re.findall(r"\bimport (kvtui(?:\.\w+)+)", text))
    found |= set(re.findall(r"python -m (kvtui(?:\.\w+)*)", text))
    return found


def test_every_module_the_docs_and_samples_name_exists():
    texts = [ROOT / "README.md", *sorted((ROOT / "samples").rglob("*.py")), *sorted((ROOT / "docs").rglob("*.md"))]
    named: set[str] = set()
    for path in texts:
        named |= _named_modules(path.read_text())
    for notebook in sorted((ROOT / "samples").rglob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        named |= _named_modules("\n".join("".join(cell["source"]) for cell in cells))
    assert "kvtui.engine.export" in named and "kvtui.engine.chat.loader" in named  # the checker reads them
    missing = sorted(m for m in named if importlib.util.find_spec(m) is None)
    assert not missing, f"named in the docs or samples but not importable: {missing}"


def test_every_engine_path_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    paths = set(re.findall(r"\b(kvtui/[\w/]+\.py)\b", readme)) | {
        f"kvtui/{p}" for p in re.findall(r"`(engine/[\w/]+\.py)", readme)
    }
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"the README names files that do not exist: {missing}"
