"""Assisted decoding on a copied prefix cache: the transformers docs' prompt-reuse recipe (prefill a prefix
once, deep-copy it per prompt, let generate() continue from the copy) with an assistant model. The program
hands generate() the copy AND the whole prompt again as new tokens (it appends the question's ids to the
prefix's ids itself, and the copy already holds them): the model reads the prefix twice. One cause, named
once at the generate() line; the verify forwards that go on continuing the doubled text are counted under it.

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
