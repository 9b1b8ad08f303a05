"""Keep a frozen reference copy of the model (copy.deepcopy, as RLHF/distillation scripts do) and save
the whole model object with torch.save; generate with the original, the copy and the reloaded one.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import copy
import io
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
inputs = tokenizer("What is the capital of France?", return_tensors="pt")

out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
print("model:", out[0].tolist())

reference = copy.deepcopy(model)
out = reference.generate(**inputs, max_new_tokens=5, do_sample=False)
print("deepcopy:", out[0].tolist())

buffer = io.BytesIO()
torch.save(model, buffer)
buffer.seek(0)
reloaded = torch.load(buffer, weights_only=False)
out = reloaded.generate(**inputs, max_new_tokens=5, do_sample=False)
print("reloaded:", out[0].tolist())
print(
    "hooks:",
    len(reference._forward_pre_hooks) + len(reference._forward_hooks),
    len(reloaded._forward_pre_hooks) + len(reloaded._forward_hooks),
)
