"""A multi-turn chat the way most tutorials write it: keep `messages`, re-render the whole history
with apply_chat_template every turn and call generate() with a fresh cache. Correct, but every turn
recomputes the system prompt and all earlier turns.

kvtui-model: tiny:qwen2
kvtui-expects: recomputed-prefix
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

messages = [{"role": "system", "content": "You are a helpful assistant."}]
for question in ["Let's start by defining a variable k equal to 5. What is k?", "Now multiply k by 3.", "What is k?"]:
    messages.append({"role": "user", "content": question})
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cache = DynamicCache(config=model.config)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=5, do_sample=False)
    reply = out[0, inputs["input_ids"].shape[1] :]
    text = tokenizer.decode(reply, skip_special_tokens=True)
    messages.append({"role": "assistant", "content": text})
    print(
        f"prompt {inputs['input_ids'].shape[1]} tokens: ids {reply.tolist()} cache {int(cache.get_seq_length())}",
        repr(text),
    )
