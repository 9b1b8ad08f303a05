"""Watching from the program's own first import of transformers: kvtui imports torch and transformers (the probe)
only once the program's imports have reached transformers' tokenizer or modeling code, never before. A program
that sets `OMP_NUM_THREADS`, `HF_HUB_OFFLINE` or `TRANSFORMERS_VERBOSITY` before its imports keeps them, one that
asks `"torch" in sys.modules` gets its own answer, and one that builds no model pays nothing.

Used by `kvtui watch SCRIPT` (headless, and the TUI's child process) and by each process of a watched tree
(tree.py). This module imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

TRIGGER = "transformers.modeling_utils"  # where PreTrainedModel lives: imported before any model is built
TOKENIZERS = "transformers.tokenization_utils_base"  # a tokenizer may be loaded before any model code


class Gate:
    """Where a front end may hold the program: before each watched forward, after each step (the probe's
    `Watcher` calls it; a `watch.child` control gate pauses and steps)."""

    def before_forward(self, watcher: Any) -> None:
        pass

    def after_step(self, watcher: Any, snapshot: Any) -> None:
        pass


class AfterImport:  # a meta path finder (duck-typed: importlib.abc costs ~10 ms in every process)
    """Runs `then()` right after the module `name` has executed, once; finds nothing itself."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once, and not while the real finders look
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]  # this one import's loader, this once
        return spec


def when_imported(name: str, then: Callable[[], None]) -> Callable[[], None]:
    """`then()` once the module `name` has executed (at once if it has); returns what takes the wait back (the
    finder left in `sys.meta_path` while the program never imported it)."""
    if name in sys.modules:
        then()
        return lambda: None
    finder = AfterImport(name, then)
    sys.meta_path.insert(0, finder)

    def undo() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    return undo


def at_first_tokenizer_load(then: Callable[[], None]) -> Callable[[], None]:
    """`then()` at the program's first tokenizer load, just before it: a stand-in `from_pretrained` puts the
    original back, calls `then()` (which may patch it) and loads. Not when the tokenizer module executes: on 4.57
    that module runs in the middle of `transformers.configuration_utils`' own imports, and the probe imports
    transformers' cache code, which would import that half-made module (an ImportError in the program). Returns
    what takes the stand-in back (when no tokenizer was loaded)."""
    base = sys.modules[TOKENIZERS].PreTrainedTokenizerBase
    original = base.__dict__["from_pretrained"]  # a classmethod object

    def from_pretrained(cls, *args, **kwargs):
        if base.__dict__.get("from_pretrained") is stand_in:
            base.from_pretrained = original
            then()
        return base.__dict__["from_pretrained"].__func__(cls, *args, **kwargs)

    stand_in = classmethod(from_pretrained)
    base.from_pretrained = stand_in

    def undo() -> None:
        if base.__dict__.get("from_pretrained") is stand_in:
            base.from_pretrained = original

    return undo


class DeferredAttach:
    """A program's AutoAttach (its models and tokenizers watched) made when the program's imports reach
    transformers: `make_watcher()` runs then (the first import of torch by kvtui), at most once."""

    def __init__(self, make_watcher: Callable[[], Any]):
        self._make_watcher = make_watcher
        self.watcher: Any = None  # a probe.Watcher, once made
        self.attach: Any = None  # its auto_attach.AutoAttach
        self._undo: list[Callable[[], None]] = []
        self.failed: str | None = None  # why the watcher could not be made or installed (the program ran on)

    def install(self) -> DeferredAttach:
        self._undo.append(when_imported(TOKENIZERS, self._tokenizer_code_loaded))
        self._undo.append(when_imported(TRIGGER, lambda: self._safely(lambda attach: attach.install_models())))
        return self

    def _safely(self, part: Callable[[Any], None]) -> None:
        """`part(the AutoAttach)`; if kvtui fails there, one line on stderr and the program runs on unwatched: it
        runs inside the program's own import or tokenizer load, which kvtui must never break."""
        if self.failed is not None:
            return
        try:
            part(self.now())
        except Exception as error:  # noqa: BLE001  never break the user's program
            self.failed = f"{type(error).__name__}: {error}"
            print(f"kvtui watch: not watching this program: {self.failed}", file=sys.stderr, flush=True)

    def now(self):
        """The AutoAttach, made (with its watcher) at the first call."""
        if self.attach is None:
            from .auto_attach import AutoAttach

            self.watcher = self._make_watcher()
            self.attach = AutoAttach(self.watcher)
        return self.attach

    def _tokenizer_code_loaded(self) -> None:
        self._undo.append(at_first_tokenizer_load(lambda: self._safely(lambda attach: attach.install_tokenizers())))

    def uninstall(self) -> None:
        """Every wait and patch taken back (the watcher itself is the caller's to detach)."""
        while self._undo:
            self._undo.pop()()
        if self.attach is not None:
            self.attach.uninstall()


def run_deferred(make_watcher: Callable[[], Any], target: str, args: list[str], module: bool = False):
    """Run a program (script or module) with every causal LM it builds watched by the watcher `make_watcher()`
    makes when the program's imports reach transformers (never, for a program that does not). Returns (the
    program's exit code, that watcher or None, "name (Class)" of each model it watched); the patches are gone
    and the watcher detached."""
    from .program import run_program

    deferred = DeferredAttach(make_watcher).install()
    try:
        code = run_program(target, args, module=module)
    finally:
        deferred.uninstall()
        watcher = deferred.watcher
        models = [f"{p.name} ({p.class_name})" for p in watcher.probes] if watcher is not None else []
        if watcher is not None:
            watcher.detach()
    return code, watcher, models


def run_watched(watcher: Any, target: str, args: list[str], module: bool = False) -> tuple[int, list[str]]:
    """`run_deferred` with a watcher already made: returns (the program's exit code, the models it watched)."""
    code, _, models = run_deferred(lambda: watcher, target, args, module=module)
    return code, models
