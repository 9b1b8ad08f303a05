"""Chat scripts for the headless runner: JSON, YAML, or a .txt file with one user turn per line."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KEYS = {"turns", "system", "mode", "prompt", "description", "expect", "options"}
# Session/CLI options a script may set for itself (command-line flags still win).
OPTION_KEYS = {
    "cache",
    "max_cache_len",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "chat_tokenize",
    "prime_pad",
    "verify_every",
    "model",
    "cache_bits",
    "cache_backend",
    "compile_decode",
}


class ScriptError(Exception):
    """A script that cannot be used: names the file and what is wrong."""


@dataclass(frozen=True)
class Script:
    turns: tuple[str, ...]
    system: str | None = None
    mode: str = "chat"
    description: str = ""
    expect: tuple[str, ...] = ()  # diagnostic codes this script exists to raise
    options: dict = field(default_factory=dict)


def load_script(path: str | Path) -> Script:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScriptError(f"{path}: no such script file") from None
    except OSError as exc:
        raise ScriptError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if path.suffix == ".txt":
        return Script(turns=tuple(line.strip() for line in text.splitlines() if line.strip()))
    data = _parse(path, text)
    return _validate(path, data)


def _parse(path: Path, text: str):
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}" if mark else ""
            raise ScriptError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScriptError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None


def _validate(path: Path, data) -> Script:
    if not isinstance(data, dict):
        raise ScriptError(f"{path}: a script is an object with 'turns' (or 'prompt' in completion mode)")
    unknown = set(data) - KEYS
    if unknown:
        raise ScriptError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(KEYS)}")
    mode = data.get("mode", "chat")
    if mode not in ("chat", "completion"):
        raise ScriptError(f"{path}: mode must be 'chat' or 'completion', not {mode!r}")
    turns = []
    listed = data.get("turns")
    if listed is not None and not isinstance(listed, list):
        # a string would be iterated one character per turn
        raise ScriptError(
            f"{path}: 'turns' must be a list of strings, not {type(listed).__name__}"
            + (f' (one turn: "turns": [{json.dumps(listed)}])' if isinstance(listed, str) else "")
        )
    for index, turn in enumerate(listed or []):
        if isinstance(turn, dict):
            role = turn.get("role", "user")
            if role != "user" or set(turn) - {"role", "content"}:
                raise ScriptError(
                    f"{path}: turn {index + 1}: only user turns are scripted ({{'role': 'user', 'content': ...}}),"
                    f" got role {role!r}"
                )
            turn = turn.get("content")
        if not isinstance(turn, str) or not turn:
            raise ScriptError(f"{path}: turn {index + 1} must be a non-empty string")
        turns.append(turn)
    if data.get("prompt") is not None:
        if not isinstance(data["prompt"], str):
            raise ScriptError(f"{path}: 'prompt' must be a string")
        turns.insert(0, data["prompt"])
    if not turns:
        raise ScriptError(f"{path}: no turns to run (give 'turns', or 'prompt' for completion mode)")
    options = data.get("options") or {}
    if not isinstance(options, dict) or set(options) - OPTION_KEYS:
        raise ScriptError(
            f"{path}: unknown options {sorted(set(options) - OPTION_KEYS) if isinstance(options, dict) else options};"
            f" allowed: {sorted(OPTION_KEYS)}"
        )
    expect = data.get("expect") or []
    if isinstance(expect, str):
        expect = [expect]
    return Script(
        turns=tuple(turns),
        system=data.get("system"),
        mode=mode,
        description=data.get("description", ""),
        expect=tuple(expect),
        options=dict(options),
    )
