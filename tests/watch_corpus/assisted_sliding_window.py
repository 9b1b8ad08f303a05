"""Assisted decoding on a model whose layers all slide (Mistral, window 8), run well past the window: a
draft that often disagrees (the same checkpoint, its weights perturbed) proposes tokens, the target verifies
them, and generate() crops the rejected ones from both caches, sliding layers included. Reported as a silent
bug (a crop against a sliding layer that has already evicted); 4.57 and 5.24 keep the reply identical to plain
greedy decoding (the test checks). Prints the reply ids and the cache length.

kvtui-model: tiny:mistral
kvtui-expects: nothing
kvtui-expects-if-assisted-caches-slide: sliding-eviction
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
draft = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
with torch.no_grad():
    for weight in draft.parameters():
        weight.add_(torch.randn_like(weight) * 0.5)  # a draft that disagrees now and then

ids = tokenizer("The quick brown fox jumps over the lazy dog again", return_tensors="pt")["input_ids"]
out = model.generate(ids, assistant_model=draft, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
print("prompt length:", ids.shape[-1])
print("reply:", out.sequences[0, ids.shape[-1] :].tolist())
print("final cache length:", int(out.past_key_values.get_seq_length()))
