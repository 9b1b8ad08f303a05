"""A shallow copy of a cache "to keep the prompt state": copy.copy shares the layer objects, so the
copy and the original grow together when generation continues on the copy (a user's surprise,
printed here, not an error).

kvtui-model: tiny:gpt2
kvtui-expects: nothing
"""

import copy
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer("The cat liked to sleep in the sun", return_tensors="pt")["input_ids"]
cache = DynamicCache()
with torch.no_grad():
    model(input_ids=ids, past_key_values=cache, use_cache=True)
saved = copy.copy(cache)
print("saved is cache:", saved is cache, "shares layers:", saved.layers is cache.layers)
full = torch.cat([ids, torch.tensor([[int(ids[0, -1])]])], dim=-1)
out = model.generate(
    full, attention_mask=torch.ones_like(full), past_key_values=saved, max_new_tokens=5, do_sample=False, pad_token_id=0
)
print("ids:", out[0, full.shape[1] :].tolist())
print("cache:", int(cache.get_seq_length()), "saved:", int(saved.get_seq_length()))
