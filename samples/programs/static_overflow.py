"""A hand-written decode loop on a StaticCache that is too small for the reply.

The cache was sized for the prompt plus a few tokens; the loop keeps going and the forward dies with
`IndexError: index_copy_(): index N is out of bounds`. kvtui warns as it fills and names the line
of the forward that overflows it.

Run:  kvtui watch samples/programs/static_overflow.py MODEL_DIR
kvtui-model: embedded
kvtui-expects: static-capacity
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache

MODEL = sys.argv[1] if len(sys.argv) > 1 else "HuggingFaceTB/SmolLM2-135M-Instruct"

tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count to twenty."}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    for _ in range(20):  # 20 > the 8 slots left
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        print("token", int(token), "cache", int(cache.get_seq_length()), flush=True)
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
