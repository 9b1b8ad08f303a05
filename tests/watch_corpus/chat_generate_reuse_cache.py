"""A multi-turn chat through generate() that keeps one cache for the whole conversation: each turn
appends the new user turn's tokens to the ids generate() returned (the cache holds all but the last
of them) and passes the same cache back. Correct reuse: nothing is recomputed, nothing is stale.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

cache = DynamicCache(config=model.config)
questions = ["Let's start by defining a variable k equal to 5. What is k?", "Now multiply k by 3.", "What is k?"]
ids = tokenizer.apply_chat_template(
    [{"role": "user", "content": questions[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)["input_ids"]
for turn, question in enumerate(questions):
    if turn:
        end = "" if int(ids[0, -1]) == tokenizer.eos_token_id else tokenizer.eos_token + "\n"
        text = f"{end}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        suffix = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = torch.cat([ids, suffix], dim=-1)
    start = ids.shape[1]
    ids = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=5, do_sample=False
    )
    print(
        f"turn {turn}: ids {ids[0, start:].tolist()} cache {int(cache.get_seq_length())}",
        repr(tokenizer.decode(ids[0, start:], skip_special_tokens=True)),
    )
