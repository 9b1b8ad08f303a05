"""Warm-up forwards before the real chat, as benchmark and torch.compile recipes write them: one token through
the model with no cache (the model makes one, the program drops it), the whole prompt with use_cache=False, and
the prompt through the chat's own cache, emptied right after (`crop(-n)`: `reset()` empties a DynamicCache on 5.x but
only zeroes it on 4.57). Then a three-turn chat through
generate() that keeps that cache. None of the warm-ups is a turn of the chat: the chat's turns are 1, 2, 3.

kvtui-model: tiny:qwen2
kvtui-expects: cache-edited
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

questions = ["Let's start by defining a variable k equal to 5. What is k?", "Now multiply k by 3.", "What is k?"]
ids = tokenizer.apply_chat_template(
    [{"role": "user", "content": questions[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)["input_ids"]
cache = DynamicCache(config=model.config)
with torch.no_grad():  # warm-up: kernels, allocator, lazy imports
    model(ids[:, :1])
    model(ids, use_cache=False)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
cache.crop(-int(cache.get_seq_length()))
print("cache after the warm-up:", int(cache.get_seq_length()))
for turn, question in enumerate(questions):
    if turn:
        end = "" if int(ids[0, -1]) == tokenizer.eos_token_id else tokenizer.eos_token + "\n"
        text = f"{end}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        suffix = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = torch.cat([ids, suffix], dim=-1)
    start = ids.shape[1]
    ids = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4, do_sample=False
    )
    print(f"turn {turn}: ids {ids[0, start:].tolist()} cache {int(cache.get_seq_length())}")
