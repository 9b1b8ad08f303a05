"""A batch of two prompts through generate(), padded on the wrong side.

Decoder-only models continue from the last column: with padding_side="right" the shorter prompt's
last column is a pad, so its first new token is predicted from padding.

Run:  kvtui watch samples/programs/right_padding.py MODEL_DIR
kvtui-model: embedded
kvtui-expects: padding-side
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1] if len(sys.argv) > 1 else "HuggingFaceTB/SmolLM2-135M-Instruct"

tokenizer = AutoTokenizer.from_pretrained(MODEL)
tokenizer.padding_side = "right"  # the default of many tokenizers, wrong for generation
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token

prompts = ["Hi", "Tell me a short story about a cat and a dog"]
batch = tokenizer(prompts, return_tensors="pt", padding=True)
out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
for row in tokenizer.batch_decode(out, skip_special_tokens=True):
    print(repr(row))
