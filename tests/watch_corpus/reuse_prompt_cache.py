"""Re-use a prompt cache, the transformers docs' recipe: prefill a shared prefix once, then for each
prompt deep-copy the prefix cache and let generate() continue from the copy.

The prefix ends on a full stop, so the prefix's tokens are a prefix of every prompt's tokens: correct.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import copy
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

INITIAL_PROMPT = "You are a helpful assistant."
inputs_initial_prompt = tokenizer(INITIAL_PROMPT, return_tensors="pt")
prompt_cache = DynamicCache()
with torch.no_grad():
    prompt_cache = model(**inputs_initial_prompt, past_key_values=prompt_cache).past_key_values

prompts = [" What is k?", " Please tell me a short story about a cat."]
responses = []
for prompt in prompts:
    new_inputs = tokenizer(INITIAL_PROMPT + prompt, return_tensors="pt")
    past_key_values = copy.deepcopy(prompt_cache)
    outputs = model.generate(**new_inputs, past_key_values=past_key_values, max_new_tokens=6, do_sample=False)
    print("ids:", outputs[0].tolist(), "cache:", int(past_key_values.get_seq_length()))
    responses.append(tokenizer.batch_decode(outputs)[0])
print(responses)
print("prompt cache:", int(prompt_cache.get_seq_length()))
