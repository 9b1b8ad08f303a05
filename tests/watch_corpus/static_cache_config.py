"""generate() with a static cache sized through the generation config, as the docs' cache pages show for
`cache_implementation="static"`: the program asks for room for 64 tokens (`cache_config={"max_cache_len":
64}`) to keep the cache for a follow-up. transformers (4.57 and 5.24) ignores the size and makes a cache with
room for the prompt plus max_new_tokens only. Prints the tokens and the room the cache got.

kvtui-model: tiny:llama
kvtui-expects: ignored-argument
kvtui-expects-if-cache-config-sizes-the-static-cache: nothing
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer("The quick brown fox jumps", return_tensors="pt")["input_ids"]
out = model.generate(
    ids,
    max_new_tokens=3,
    do_sample=False,
    cache_implementation="static",
    cache_config={"max_cache_len": 64},
    return_dict_in_generate=True,
)
cache = out.past_key_values
print("tokens:", out.sequences[0, ids.shape[-1] :].tolist())
print("asked room: 64, got room:", int(cache.layers[0].max_cache_len))
print("final cache length:", int(cache.get_seq_length()))
