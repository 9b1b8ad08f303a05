"""A correct loop: the template's own ids, a hand-written prefill + decode on a DynamicCache with the
cache's own length as the cursor, then generate() continuing from the same cache. kvtui raises
nothing on it.

Run:  kvtui watch samples/programs/correct_loop.py MODEL_DIR
kvtui-model: embedded
kvtui-expects: nothing
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1] if len(sys.argv) > 1 else "HuggingFaceTB/SmolLM2-135M-Instruct"

tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
cache = DynamicCache(config=model.config)
fed = ids
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    for _ in range(4):
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        fed = torch.cat([fed, token], dim=-1)
        out = model(input_ids=token, past_key_values=cache, use_cache=True)  # positions from the cache length
    # generate() continues: it feeds only what the cache lacks (the last chosen token)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    full = torch.cat([fed, token], dim=-1)
    out = model.generate(full, past_key_values=cache, attention_mask=torch.ones_like(full), max_new_tokens=4,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
