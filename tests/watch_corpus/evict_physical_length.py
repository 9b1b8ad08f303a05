"""StreamingLLM by hand, with the bug people write: after keeping the sinks (positions 0-3) and the last
24 tokens of every layer, decode at the cache's physical length (28, 29, ...) while the kept keys still carry
the rotation of the positions they were fed at: RoPE sees distances shrunk by the evicted middle. No error is
raised; the text degrades. kvtui says the eviction and the position gap it causes. Prints the tokens.

kvtui-model: tiny:llama
kvtui-expects: cache-evicted, position-gap
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
    for _step in range(4):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        position = torch.tensor([[int(cache.get_seq_length())]])  # physical: the bug
        out = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True)
print("prompt:", length, "tokens:", tokens)
print("cache length:", int(cache.get_seq_length()))
