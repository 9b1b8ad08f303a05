"""One cache reused across independent prompts, ids from tokenizer.encode(...) (a list, wrapped in a
tensor by hand). Every prompt after the first continues a cache that holds another prompt.

kvtui-model: tiny:qwen3
kvtui-expects: stale-cache
kvtui-exit-if-cache-position-drives-positions: 1

Where generate() slices the prompt by cache_position (4.57), the third prompt is shorter than the cache: generate()
raises IndexError before that forward (exit 1), after kvtui named the second prompt's stale cache.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

cache = DynamicCache(config=model.config)
questions = [
    "What is 12 plus 30?",
    "Is 100 divided by 4 equal to 25? Answer the question.",
    "Define a variable x equal to 7, and a variable y equal to 9. What is x multiplied by y?",
]
for question in questions:
    ids = torch.tensor([tokenizer.encode(question)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4, do_sample=False
    )
    print("ids:", out[0, ids.shape[1] :].tolist(), "cache:", int(cache.get_seq_length()))
