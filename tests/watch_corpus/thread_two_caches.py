"""Two worker threads, each running a user function that generates with its own DynamicCache, started
together; the results are collected and printed in order after both joined.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import sys
import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
results = {}


def worker(name: str, prompt: str) -> None:
    inputs = tokenizer(prompt, return_tensors="pt")
    cache = DynamicCache(config=model.config)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=6, do_sample=False)
    results[name] = (out[0, inputs["input_ids"].shape[1] :].tolist(), int(cache.get_seq_length()))


threads = [
    threading.Thread(target=worker, args=("a", "What is 12 plus 30?")),
    threading.Thread(target=worker, args=("b", "Please tell me a short story about a cat.")),
]
for t in threads:
    t.start()
for t in threads:
    t.join()
for name in sorted(results):
    ids, length = results[name]
    print(name, "ids:", ids, "cache:", length)
