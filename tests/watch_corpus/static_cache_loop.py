"""A hand-written greedy loop on a StaticCache sized for the whole reply (the torch.compile-friendly
recipe), with explicit position ids.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer.apply_chat_template(
    [{"role": "user", "content": "Count from 0 to 9."}],
    add_generation_prompt=True,
    return_tensors="pt",
    return_dict=True,
)["input_ids"]
cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 16)
generated = []
with torch.no_grad():
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    for step in range(8):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(int(token))
        position = torch.tensor([[ids.shape[1] + step]])
        out = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True)
print("ids:", generated)
print("cache:", int(cache.get_seq_length()), "of", ids.shape[1] + 16)
