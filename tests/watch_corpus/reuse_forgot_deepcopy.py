"""The prompt-reuse recipe without the deepcopy: one DynamicCache handed to generate() for several
independent prompts (ids from tokenizer(...)). The first call fills it; every later call continues
from the previous prompt and answer, feeding only the new prompt's tokens past the cache length.
No error: the later answers are just wrong.

kvtui-model: tiny:qwen2
kvtui-expects: stale-cache
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

cache = DynamicCache()
prompts = [
    "What is k?",
    "What is the capital of France? Please answer.",
    "Please tell me a short story about a cat. Once upon a time, a small cat lived in a quiet house.",
]
for prompt in prompts:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    print("ids:", new.tolist(), "cache:", int(cache.get_seq_length()), repr(tokenizer.decode(new)))
