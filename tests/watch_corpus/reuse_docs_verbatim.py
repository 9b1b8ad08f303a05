"""The docs' prompt-reuse recipe copied verbatim, trailing space included: INITIAL_PROMPT ends with
"assistant. ", so the cached prefix ends on a lone space token, while INITIAL_PROMPT + prompt
tokenizes that space into the next word (" What"). generate() feeds only the tokens past the cache
length: the model continues from a cache holding a token the prompt does not contain.

kvtui-model: tiny:qwen2
kvtui-expects: stale-cache
"""

import copy
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

INITIAL_PROMPT = "You are a helpful assistant. "
inputs_initial_prompt = tokenizer(INITIAL_PROMPT, return_tensors="pt")
prompt_cache = DynamicCache()
with torch.no_grad():
    prompt_cache = model(**inputs_initial_prompt, past_key_values=prompt_cache).past_key_values

prompts = ["What is k?", "Please tell me a short story about a cat."]
responses = []
for prompt in prompts:
    new_inputs = tokenizer(INITIAL_PROMPT + prompt, return_tensors="pt")
    past_key_values = copy.deepcopy(prompt_cache)
    outputs = model.generate(**new_inputs, past_key_values=past_key_values, max_new_tokens=6, do_sample=False)
    print("ids:", outputs[0].tolist(), "cache:", int(past_key_values.get_seq_length()))
    responses.append(tokenizer.batch_decode(outputs)[0])
print(responses)
