"""What the watch tests read from a sample or corpus program: its header lines (`kvtui-model:`,
`kvtui-expects:`, `kvtui-stdin:`), its model directory, and the alarm codes a trace of it holds."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path


def header(path: Path, key: str, default: str | None = None) -> str:
    found = re.search(rf"^{key}: (.+)$", path.read_text(), re.M)
    if found is None and default is not None:
        return default
    return found.group(1).strip()


def cache_position_drives_positions() -> bool:
    """Feature test of the installed transformers: do the models take `cache_position` (4.x: a passed one
    drives the positions and the write slots), or ignore it (5.4+: no such parameter)? Read from the
    forward's signature, the same test kvtui's probe makes (introspect.forward_accepts)."""
    import inspect

    from transformers import LlamaForCausalLM

    return "cache_position" in inspect.signature(LlamaForCausalLM.forward).parameters


@functools.cache
def _one_layer_llama():
    """A one-layer Llama built in memory (no files, well under a second), for the feature tests below."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _filled_cache(model, ids=(1, 2, 3, 4)):
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([list(ids)]), past_key_values=cache, use_cache=True)
    return cache


@functools.cache
def use_cache_false_leaves_the_cache() -> bool:
    """Feature test of the installed transformers: does a forward with `use_cache=False` leave the cache it
    was passed as it was? 5.24 writes the fed tokens into it anyway (4 -> 7 here); a fixed version keeps 4."""
    import torch

    model = _one_layer_llama()
    cache = _filled_cache(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=False)
    return int(cache.get_seq_length()) == 4


@functools.cache
def crop_zero_empties_the_cache() -> bool:
    """Feature test: does `cache.crop(0)` keep 0 tokens (4.x: the argument is the length to keep) or remove
    0 (5.x: the argument is the number of tokens to remove, crop(-n))?"""
    cache = _filled_cache(_one_layer_llama())
    cache.crop(0)
    return int(cache.get_seq_length()) == 0


@functools.cache
def cache_config_sizes_the_static_cache() -> bool:
    """Feature test: does generate(cache_implementation="static", cache_config={"max_cache_len": N}) make a
    static cache with room for N? 4.57 and 5.24 size it to the prompt plus max_new_tokens (4 + 1 here)."""
    import torch

    out = _one_layer_llama().generate(
        torch.tensor([[1, 2, 3, 4]]),
        max_new_tokens=1,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
        cache_config={"max_cache_len": 16},
        return_dict_in_generate=True,
    )
    return int(out.past_key_values.layers[0].max_cache_len) == 16


@functools.cache
def assisted_caches_slide() -> bool:
    """Feature test: does assisted generate() on a sliding-window model (tiny Mistral, window 8) make a cache
    whose layers slide? 5.x: yes (they keep only the window); 4.57: full layers there (plain generate() slides)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("tiny:mistral"), dtype=torch.float32)
    out = model.generate(
        torch.tensor([list(range(4, 16))]),
        assistant_model=model,
        max_new_tokens=2,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    return any("Sliding" in type(layer).__name__ for layer in out.past_key_values.layers)


@functools.cache
def continuous_batching_is_missing() -> bool:
    """Feature test: does this transformers lack the continuous-batching API a CPU run needs (5.x has
    ContinuousBatchingConfig; 4.57 does not, and sizes its paged cache from GPU memory)?"""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return True
    return False


# A header that replaces `kvtui-expects:` where the installed transformers has the feature it names.
FEATURE_HEADERS = {
    "kvtui-expects-if-cache-position-drives-positions": cache_position_drives_positions,
    "kvtui-expects-if-use-cache-false-leaves-the-cache": use_cache_false_leaves_the_cache,
    "kvtui-expects-if-crop-zero-empties-the-cache": crop_zero_empties_the_cache,
    "kvtui-expects-if-cache-config-sizes-the-static-cache": cache_config_sizes_the_static_cache,
    "kvtui-expects-if-assisted-caches-slide": assisted_caches_slide,
    "kvtui-expects-if-continuous-batching-is-missing": continuous_batching_is_missing,
}


def expects_line(path: Path) -> str:
    """The program's `kvtui-expects:` for the installed transformers (a feature header wins where it holds)."""
    for key, has_feature in FEATURE_HEADERS.items():
        line = header(path, key, "")
        if line and has_feature():
            return line
    return header(path, "kvtui-expects")


def expected_exit(path: Path) -> int:
    """The program's own exit code on the installed transformers (`kvtui-exit-if-...: N`; else 0)."""
    for key, has_feature in FEATURE_HEADERS.items():
        line = header(path, key.replace("kvtui-expects-", "kvtui-exit-"), "")
        if line and has_feature():
            return int(line)
    return 0


def expected_codes(path: Path) -> set[str]:
    expected = expects_line(path)
    return set() if expected == "nothing" else {c.strip() for c in expected.split(",")}


def stdin_of(program: Path) -> str | None:
    """An interactive program's input (`kvtui-stdin: line | line`), one line each; None: no input (EOF)."""
    lines = header(program, "kvtui-stdin", "")
    return "".join(line.strip() + "\n" for line in lines.split("|")) if lines else None


def model_dir(spec: str) -> Path:
    from kvtui.engine.chat.loader import embedded_model_dir, tiny_model_dir

    return embedded_model_dir() if spec == "embedded" else tiny_model_dir(spec)


def codes_in(trace: Path) -> set[str]:
    codes = set()
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "step":
            codes.update(d["code"] for d in record["diagnostics"])
        elif record["type"] == "diagnostic":
            codes.add(record["code"])
    return codes
