"""Independent single-turn chats (same system prompt) through apply_chat_template, all sharing one
cache: the system prompt matches, the user turn after it does not.

kvtui-model: tiny:qwen2
kvtui-expects: stale-cache
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
cache = DynamicCache(config=model.config)
for question in ["What is k?", "What is the capital of France? Answer the question, then explain your reasoning."]:
    inputs = tokenizer.apply_chat_template(
        [SYSTEM, {"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=5, do_sample=False)
    answer = out[0, inputs["input_ids"].shape[1] :]
    print(
        "ids:",
        answer.tolist(),
        "cache:",
        int(cache.get_seq_length()),
        repr(tokenizer.decode(answer, skip_special_tokens=True)),
    )
