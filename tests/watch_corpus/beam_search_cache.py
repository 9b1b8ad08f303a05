"""Beam search (num_beams=2) with a cache the program created and passed in; generate() reorders it
between steps.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

inputs = tokenizer("The cat liked to sleep in the sun, near the window.", return_tensors="pt")
cache = DynamicCache()
out = model.generate(
    **inputs, past_key_values=cache, num_beams=2, max_new_tokens=6, do_sample=False, early_stopping=True
)
print("ids:", out[0].tolist())
print("cache:", int(cache.get_seq_length()))
print(repr(tokenizer.decode(out[0], skip_special_tokens=True)))
