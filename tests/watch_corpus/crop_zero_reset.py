"""One cache for a batch of independent prompts, "emptied" before each one with `cache.crop(0)`, written for
transformers 4.x where crop's argument was the number of tokens to keep. On 5.x the argument is the number
of tokens to remove, so crop(0) removes none: every prompt continues the previous prompt's tokens and its
answer with them. Prints each answer's ids and the cache length before and after each crop.

kvtui-model: tiny:qwen2
kvtui-expects: edit-changed-nothing, stale-cache
kvtui-expects-if-crop-zero-empties-the-cache: cache-edited
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

PROMPTS = [
    "Name a color.",
    "Write one short sentence about a quiet harbour at dawn.",
    "List three animals that live in cold places, then say which one is the largest.",
]
cache = DynamicCache()
for prompt in PROMPTS:
    before = int(cache.get_seq_length())
    cache.crop(0)  # start over: keep 0 tokens
    print("crop(0):", before, "->", int(cache.get_seq_length()))
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4, do_sample=False)
    print("answer ids:", out[0, inputs["input_ids"].shape[-1] :].tolist(), "cache:", int(cache.get_seq_length()))
