"""The engine imports no Textual or Rich: checked in a fresh interpreter."""

import subprocess
import sys


def test_engine_imports_no_ui_libraries():
    code = (
        "import sys, kvtui.engine, kvtui.engine.chat.session, kvtui.engine.chat.loader, kvtui.engine.records.trace, "
        "kvtui.engine.chat.script, kvtui.engine.models.tiny\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"engine pulled in: {out.stdout.strip()}"


def test_only_session_calls_the_model_with_a_cache():
    from pathlib import Path

    engine = Path(__file__).resolve().parents[2] / "kvtui"
    # passing a cache: by its pre-5.24 name, or by the name introspect says the model takes (`cache` from 5.24)
    callers = sorted(
        str(p.relative_to(engine))
        for p in engine.rglob("*.py")
        if any(marker in p.read_text() for marker in ("past_key_values=", "introspect.cache_argument("))
    )
    assert callers == ["engine/chat/session.py"]


def test_the_tui_draws_without_importing_torch():
    """The first frame must not wait for torch and transformers: they load in the model worker."""
    code = "import sys, kvtui.cli, kvtui.app\nprint(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_batching_half_reads_cache_internals_only_through_reading():
    """engine/batching reads the batch processor's requests and inputs; the paged cache's internals (block tables,
    free lists, group indices: private attributes) are read in reading/introspect/paged.py only."""
    import ast
    from pathlib import Path

    batching = Path(__file__).resolve().parents[2] / "kvtui" / "engine" / "batching"
    private = []
    for path in batching.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("getattr", "hasattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")
            ):
                private.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                private.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert private == []
