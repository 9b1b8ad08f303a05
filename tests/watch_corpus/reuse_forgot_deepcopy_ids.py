"""A benchmark script: prompts are precomputed lists of token ids (dumped from a dataset), each run
through generate() with the same cache object "to save allocations".

kvtui-model: tiny:llama
kvtui-expects: stale-cache
"""

import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

PROMPTS = [
    [1, 470, 430, 6, 408, 362, 338, 271, 500],
    [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314],
    [1, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131, 132, 133, 134, 135, 136, 137, 138, 139, 140],
]
cache = DynamicCache()
for prompt in PROMPTS:
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
    )
    print("ids:", out[0, len(prompt) :].tolist(), "cache:", int(cache.get_seq_length()))
