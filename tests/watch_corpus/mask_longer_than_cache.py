"""A greedy decode loop that keeps its own attention mask beside an external cache, the way older examples
do. It builds the mask for the whole prompt once, then at every step appends a column for the new token and
another for the token it just appended to its own list of ids, so the mask grows two columns a step while the
cache grows one. Nothing raises: the model reads the mask's columns against the cache's slots, and every
step after the first is masked against the wrong columns. Prints the tokens and the two lengths.

kvtui-model: tiny:llama
kvtui-expects: mask-length
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

batch = tokenizer("The quick brown fox jumps", return_tensors="pt")
ids, mask = batch["input_ids"], batch["attention_mask"]
cache = DynamicCache()
tokens = []
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for step in range(4):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        ids = torch.cat([ids, token], dim=-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)  # the new token's column
        step_mask = torch.cat([mask, torch.ones_like(token)], dim=-1)  # ...and once more for the fed token
        out = model(input_ids=token, attention_mask=step_mask, past_key_values=cache, use_cache=True)
        mask = step_mask
        print("step", step, "mask columns:", mask.shape[-1], "cache length:", int(cache.get_seq_length()))
print("tokens:", tokens)
print("final cache length:", int(cache.get_seq_length()))
