"""A chat loop that primes its cache with pad tokens and keeps its own cursor.

The author "warms up" a DynamicCache with a dummy forward of pad tokens, then counts positions in a
private cursor `cp` that starts at 0, passes it as cache_position, and feeds each turn as the
re-rendered chat sliced at `cp`. Nothing errors; the answers are subtly worse.

Run:  kvtui watch samples/programs/primed_pads.py MODEL_DIR
kvtui-model: embedded
kvtui-expects: pad-in-cache, cursor-mismatch, ignored-argument
kvtui-expects-if-cache-position-drives-positions: pad-in-cache, cursor-mismatch, position-gap

On transformers 5.4+ the models ignore cache_position (ignored-argument): they write and rotate at the cache's
own length. On 4.57 the passed cursor drives the positions: the new tokens are rotated from 0 while 32 pads
precede them in the cache (position-gap).
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1] if len(sys.argv) > 1 else "HuggingFaceTB/SmolLM2-135M-Instruct"
PRIME = 32  # the real program used 1,024

tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

cache = DynamicCache(config=model.config)
with torch.no_grad():
    model(input_ids=torch.full((1, PRIME), pad_id), past_key_values=cache, use_cache=True)  # "warm-up"

cp = 0  # our own cursor: where the next token goes (it ignores the warm-up)
messages = []
for question in ["What is k if k = 5?", "Multiply k by 3."]:
    messages.append({"role": "user", "content": question})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    new = ids[:, cp:]
    reply = []
    with torch.no_grad():
        for _ in range(6):
            out = model(input_ids=new, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(cp, cp + new.shape[1]))
            cp += new.shape[1]
            token = int(out.logits[0, -1].argmax())
            reply.append(token)
            new = torch.tensor([[token]])
    # the last sampled token was never fed: the next rendering starts right after the cached ones
    messages.append({"role": "assistant", "content": tokenizer.decode(reply[:-1], skip_special_tokens=True)})
    cp = ids.shape[1] + len(reply) - 1
    print(f"turn {len(messages) // 2}: {len(reply)} tokens, cp={cp}")
