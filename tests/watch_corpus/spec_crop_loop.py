"""Prompt-lookup speculative decoding written by hand: guess the next K tokens by finding the last
token earlier in the context and copying what followed it, feed the K guesses in one forward, keep
the ones the model agrees with and crop the cache back over the rejected ones.

kvtui-model: tiny:llama
kvtui-expects: cache-edited
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
K = 3
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def guess(context: list[int], k: int) -> list[int]:
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last and i + 1 < len(context):
            found = context[i + 1 : i + 1 + k]
            return (found + [last] * k)[:k]
    return [last] * k


ids = tokenizer("Count from 0 to 9: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9. Count from 0 to 9: 0, 1,", return_tensors="pt")[
    "input_ids"
]
context = ids[0].tolist()
cache = DynamicCache()
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    next_token = int(out.logits[0, -1].argmax())
    generated = [next_token]
    while len(generated) < 12:
        draft = guess(context + generated, K)
        feed = torch.tensor([[generated[-1]] + draft])  # the last accepted token plus K guesses
        out = model(input_ids=feed, past_key_values=cache, use_cache=True)
        predicted = out.logits[0].argmax(-1).tolist()  # predicted[i]: the token after feed[i]
        accepted = 0
        while accepted < K and draft[accepted] == predicted[accepted]:
            accepted += 1
        generated += draft[:accepted] + [predicted[accepted]]
        rejected = K - accepted
        if rejected:
            cache.crop(-rejected)
        print(f"draft {draft} accepted {accepted} cache {int(cache.get_seq_length())}")
print("ids:", generated)
print("cache:", int(cache.get_seq_length()), "context:", len(context) + len(generated) - 1)
