"""Branch a cache: deep-copy it, rewind the copy by two tokens with crop, and continue the copy along
another path while the original stays as it was. Prints both caches' lengths at every step.

kvtui-model: tiny:qwen2
kvtui-expects: cache-edited
"""

import copy
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

ids = tokenizer("Once upon a time, a small cat lived in a quiet house.", return_tensors="pt")["input_ids"]
c = DynamicCache()
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=c, use_cache=True)
    tokens = []
    for _ in range(4):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        out = model(input_ids=token, past_key_values=c, use_cache=True)
    print("c after decoding:", int(c.get_seq_length()), "tokens:", tokens)

    c2 = copy.deepcopy(c)
    c2.crop(-2)
    print("after c2.crop(-2): c", int(c.get_seq_length()), "c2", int(c2.get_seq_length()))

    # the branch: feed the second-to-last token again, then decode greedily on c2
    token = torch.tensor([[tokens[-2]]])
    branch = []
    for _ in range(4):
        out = model(input_ids=token, past_key_values=c2, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        branch.append(int(token))
    print("branch tokens:", branch)
    print("final: c", int(c.get_seq_length()), "c2", int(c2.get_seq_length()))
    # the original continues too
    out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=c, use_cache=True)
    print("original next:", int(out.logits[0, -1].argmax()), "c", int(c.get_seq_length()))
