"""Greedy decoding that scores a look-ahead before committing each token: the candidate continuation is
run through the model with `use_cache=False`, meant as a read-only forward on the decoding cache. On
transformers 5.x the model writes the scored tokens into the cache anyway (16 -> 19 tokens), so every later
step attends to a continuation the text never had. Prints the tokens, the look-ahead scores and the cache
length after every step.

kvtui-model: tiny:llama
kvtui-expects: cache-written-without-use-cache
kvtui-expects-if-use-cache-false-leaves-the-cache: nothing
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer("The quick brown fox jumps", return_tensors="pt")["input_ids"]
cache = DynamicCache()
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    tokens = []
    for step in range(3):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        # score a three-token look-ahead "without touching the cache"
        lookahead = torch.cat([token, token, token], dim=-1)
        scores = model(input_ids=lookahead, past_key_values=cache, use_cache=False).logits
        print("step", step, "look-ahead score:", round(float(scores[0, -1].max()), 4))
        tokens.append(int(token))
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        print("cache length:", int(cache.get_seq_length()))
print("tokens:", tokens)
print("final cache length:", int(cache.get_seq_length()))
