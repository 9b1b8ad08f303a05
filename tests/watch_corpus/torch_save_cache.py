"""torch.save a prefilled cache into a buffer (as one would to disk), torch.load it back
(weights_only=False: a cache is not a plain tensor dict) and continue generation from the loaded copy.

kvtui-model: tiny:llama
kvtui-expects: nothing
"""

import io
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

inputs = tokenizer("Define a variable x equal to 7, and a variable y equal to 9.", return_tensors="pt")
cache = DynamicCache(config=model.config)
with torch.no_grad():
    out = model(**inputs, past_key_values=cache, use_cache=True)
buffer = io.BytesIO()
torch.save(cache, buffer)
print("saved", buffer.tell() > 0, "cache:", int(cache.get_seq_length()))
buffer.seek(0)
loaded = torch.load(buffer, weights_only=False)

first = out.logits[:, -1].argmax(-1, keepdim=True)
ids = torch.cat([inputs["input_ids"], first], dim=-1)
gen = model.generate(
    ids, attention_mask=torch.ones_like(ids), past_key_values=loaded, max_new_tokens=6, do_sample=False
)
print("ids:", gen[0, inputs["input_ids"].shape[1] :].tolist())
print("loaded:", int(loaded.get_seq_length()), "original:", int(cache.get_seq_length()))
