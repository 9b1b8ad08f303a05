"""StreamingLLM by hand: prefill a long prompt, then keep the attention sinks (positions 0-3) and the last 24
tokens of every layer by slicing the cache, and decode on at the logical positions (the kept keys carry the
rotation of the positions they were fed at, so the next token goes at the prompt's length). Correct: kvtui says
the eviction and raises nothing. Prints the tokens and the cache's length.

kvtui-model: tiny:llama
kvtui-expects: cache-evicted
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
SINKS, WINDOW = 4, 24
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer(" ".join(["the quick brown fox jumps over the lazy dog"] * 8), return_tensors="pt")["input_ids"]
length = ids.shape[-1]
cache = DynamicCache()
tokens = []
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    for layer in cache.layers:  # keep the sinks and the window: the middle goes
        layer.keys = torch.cat([layer.keys[:, :, :SINKS], layer.keys[:, :, -WINDOW:]], dim=-2)
        layer.values = torch.cat([layer.values[:, :, :SINKS], layer.values[:, :, -WINDOW:]], dim=-2)
    for step in range(4):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        position = torch.tensor([[length + step]])  # logical: where the kept keys' rotation continues
        out = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True)
print("prompt:", length, "tokens:", tokens)
print("cache length:", int(cache.get_seq_length()))
