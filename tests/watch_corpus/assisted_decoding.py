"""Assisted (speculative) decoding: generate(..., assistant_model=draft), where the draft is the same
checkpoint loaded with only its first layer (self-speculative decoding); both share the tokenizer.
generate() crops both caches itself when the draft's guesses are rejected. The assisted run re-encodes
the prompt the plain run's (discarded) cache held: that is the waste kvtui names (info).

kvtui-model: tiny:llama
kvtui-expects: recomputed-prefix
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
draft = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, num_hidden_layers=1)

inputs = tokenizer("Count from 0 to 9: 0, 1, 2, 3,", return_tensors="pt")
plain = model.generate(**inputs, max_new_tokens=10, do_sample=False)
assisted = model.generate(**inputs, assistant_model=draft, max_new_tokens=10, do_sample=False)
print("plain:   ", plain[0].tolist())
print("assisted:", assisted[0].tolist())
print("same:", plain[0].tolist() == assisted[0].tolist())
