"""A hand-written greedy loop over a model with sliding and full layers (Gemma 3: three sliding layers, then
a full one) that reads the cache's length the way older examples do, from the first layer's keys. That layer
is a sliding one: it holds at most its window, so the positions the loop passes stop growing at the window
while the full layer keeps every token. Prints the tokens, the length the loop read and the cache's own.

kvtui-model: tiny:gemma3
kvtui-expects: sliding-eviction, position-gap
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer("The quick brown fox jumps over the lazy dog again", return_tensors="pt")["input_ids"]
cache = DynamicCache(config=model.config)
tokens = []
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    for step in range(4):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        past_length = cache.layers[0].keys.shape[-2]  # the "cache length", read from layer 0
        positions = torch.tensor([[past_length]])
        out = model(input_ids=token, past_key_values=cache, position_ids=positions, use_cache=True)
        print("step", step, "read length:", past_length, "cache length:", int(cache.get_seq_length()))
print("tokens:", tokens)
print("final cache length:", int(cache.get_seq_length()))
