"""A completion loop that trusts the tokenizer's defaults and "peeks" at the cache.

tokenizer(prompt) quietly appends EOS ("prompt of 862 tokens, cache of 863"), so the model continues
after an end-of-text marker. Then, to look one token ahead "without changing anything", the loop runs a
forward on the shared cache and crops it back in place.

Run:  kvtui tiny --arch llama --eos --out /tmp/tiny-eos && kvtui watch samples/programs/hidden_eos.py /tmp/tiny-eos
kvtui-model: tiny:llama,eos=1
kvtui-expects: tokenizer-added-special, eos-in-context, cache-edited
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1] if len(sys.argv) > 1 else "HuggingFaceTB/SmolLM2-135M-Instruct"

tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

prompt = "The capital of France is"
ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # defaults: special tokens added
cache = DynamicCache(config=model.config)
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    generated = []
    for step in range(8):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if step == 3:  # a "read-only" peek at what would come two tokens later
            peek = model(input_ids=token, past_key_values=cache, use_cache=True)
            print("peek:", tokenizer.decode(peek.logits[0, -1].argmax()))
            cache.crop(-1)  # undo the peek
        generated.append(int(token))
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
print(prompt + tokenizer.decode(generated))
