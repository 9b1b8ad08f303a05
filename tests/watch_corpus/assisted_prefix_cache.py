"""Assisted decoding on a copied prefix cache: the transformers docs' prompt-reuse recipe (prefill a prefix
once, deep-copy it per prompt, let generate() continue from the copy) with an assistant model. The program
builds its prompt ids as prefix + prefix + question (a prefix glued on twice), so generate() feeds the copy a
prefix it already holds: the model reads it twice. One cause, named once at the generate() line; the verify
forwards of that call (between the assistant's own generate() calls) are not re-explained as another cause.

kvtui-model: tiny:llama
kvtui-expects: stale-cache
"""

import copy
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
draft = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, num_hidden_layers=1)

PREFIX = "You are a helpful assistant. Answer in one short line, and count from 0 to 9 when asked to count."
prefix_ids = tokenizer(PREFIX, return_tensors="pt").input_ids
prefix_cache = DynamicCache()
with torch.no_grad():
    prefix_cache = model(input_ids=prefix_ids, past_key_values=prefix_cache).past_key_values

question = tokenizer(" Count from 0 to 9: 0, 1, 2,", return_tensors="pt").input_ids
ids = torch.cat([prefix_ids, prefix_ids, question], dim=-1)
cache = copy.deepcopy(prefix_cache)
out = model.generate(ids, past_key_values=cache, assistant_model=draft, max_new_tokens=12, do_sample=False)
print("ids:", out[0].tolist(), "cache:", int(cache.get_seq_length()))
print("prefix cache:", int(prefix_cache.get_seq_length()))
