"""Evaluate checkpoints one after another in one process, freeing each before loading the next (as
sweep and eval scripts do to fit in memory): `del model` + `gc.collect()`, and a weak reference tells
whether the model and its cache were really released.

kvtui-model: tiny:llama
kvtui-expects: nothing
"""

import gc
import sys
import weakref

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
inputs = tokenizer("The capital of France is", return_tensors="pt")

for checkpoint in range(2):
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4, do_sample=False)
    print(f"checkpoint {checkpoint}:", out[0].tolist(), "cache", int(cache.get_seq_length()))
    model_ref, cache_ref = weakref.ref(model), weakref.ref(cache)
    del model, cache, out
    gc.collect()
    print(f"checkpoint {checkpoint} freed: model {model_ref() is None}, cache {cache_ref() is None}")
