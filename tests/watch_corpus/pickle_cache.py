"""Save a prefilled prompt cache with pickle (to reuse it in another process later), load it back and
let generate() continue from the loaded copy; the original is left as it was.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import pickle
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

prefix = tokenizer("You are a helpful assistant.", return_tensors="pt")
cache = DynamicCache()
with torch.no_grad():
    model(**prefix, past_key_values=cache, use_cache=True)
blob = pickle.dumps(cache)
print("pickled:", int(cache.get_seq_length()), "tokens")

restored = pickle.loads(blob)
inputs = tokenizer("You are a helpful assistant. What is 12 plus 30?", return_tensors="pt")
out = model.generate(**inputs, past_key_values=restored, max_new_tokens=6, do_sample=False)
print("ids:", out[0, inputs["input_ids"].shape[1] :].tolist())
print("restored:", int(restored.get_seq_length()), "original:", int(cache.get_seq_length()))
