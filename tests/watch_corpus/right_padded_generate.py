"""A batch of two prompts of different lengths through generate(), padded the tokenizer's default way for
this model (on the right), with the cache kept for a look afterwards. The shorter row's next token is
predicted from its pad slots, and its new tokens are written after them. Prints the generated ids, the
cache length and the decoded replies.

kvtui-model: tiny:llama
kvtui-expects: padding-side
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="right")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token

batch = tokenizer(["Hello!", "Please tell me a short story about a cat."], return_tensors="pt", padding=True)
cache = DynamicCache()
out = model.generate(
    **batch, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id
)
for row in out.tolist():
    print("ids:", row)
print("cache:", int(cache.get_seq_length()))
print(tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True))
