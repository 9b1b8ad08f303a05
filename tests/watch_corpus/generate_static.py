"""generate(..., cache_implementation="static"): transformers builds and sizes the StaticCache itself.

kvtui-model: tiny:llama
kvtui-expects: nothing
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

inputs = tokenizer("What is x multiplied by y?", return_tensors="pt")
out = model.generate(
    **inputs, cache_implementation="static", max_new_tokens=8, do_sample=False, return_dict_in_generate=True
)
print("ids:", out.sequences[0].tolist())
cache = out.past_key_values
print("cache:", type(cache).__name__, int(cache.get_seq_length()))
