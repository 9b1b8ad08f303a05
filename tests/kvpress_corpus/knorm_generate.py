"""kvpress the way its README starts: `with press(model): model.generate(...)`. KnormPress keeps half of the
prompt's tokens in every layer (per KV head, by key norm) during the prefill; generate() then decodes at the
uncompressed positions (its cache_position counts every prompt token), which is right: the kept keys carry the
rotation of the positions they were fed at. kvtui says the eviction and raises nothing.

kvtui-model: tiny:llama
kvtui-expects: cache-evicted
kvtui-press: KnormPress(compression_ratio=0.5)
"""

import sys

import torch
from kvpress import KnormPress
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
ids = tokenizer(" ".join(["the quick brown fox jumps over the lazy dog"] * 4), return_tensors="pt")["input_ids"]
press = KnormPress(compression_ratio=0.5)
with torch.no_grad(), press(model):
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
print("prompt:", ids.shape[-1], "tokens:", out.sequences[0, ids.shape[-1] :].tolist())
print("cache length:", int(out.past_key_values.get_seq_length()))
