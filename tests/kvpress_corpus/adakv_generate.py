"""kvpress's head-wise press through generate(): AdaKVPress keeps every slot and masks, per KV head, the keys its
scorer ranks lowest across heads (module.masked_key_indices; kvpress's attention patch gives them weight 0 from the
next forward on). The cache's length stays the prompt's, the positions are the uncompressed ones: right. kvtui says
what each head masked and raises nothing.

kvtui-model: tiny:llama
kvtui-expects: cache-evicted
kvtui-press: AdaKVPress(KnormPress(compression_ratio=0.5))
"""

import sys

import torch
from kvpress import AdaKVPress, KnormPress
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
ids = tokenizer(" ".join(["the quick brown fox jumps over the lazy dog"] * 4), return_tensors="pt")["input_ids"]
press = AdaKVPress(KnormPress(compression_ratio=0.5))
with torch.no_grad(), press(model):
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
print("prompt:", ids.shape[-1], "tokens:", out.sequences[0, ids.shape[-1] :].tolist())
print("cache length:", int(out.past_key_values.get_seq_length()))
masked = model.model.layers[0].self_attn.masked_key_indices
print("masked in layer 0:", len(masked[0]))
