"""kvpress's own pipeline: `pipeline("kv-press-text-generation")` prefills the context under the press with the
decoder alone (`model.model`, no LM head), then answers each question with explicit position_ids that start at
the context's length (logical positions: right, the kept keys carry their original rotation), and after each
answer cuts the cache back to the compressed context by slicing. StreamingLLMPress keeps the first tokens and
the last ones. kvtui says the eviction and each cut, and raises nothing.

kvtui-model: tiny:llama
kvtui-expects: cache-evicted
kvtui-press: StreamingLLMPress(compression_ratio=0.5, n_sink=4)
"""

import sys

import torch
from kvpress import StreamingLLMPress
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
context = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
press = StreamingLLMPress(compression_ratio=0.5, n_sink=4)
answers = pipe(context, questions=["the fox", "the dog"], press=press, max_new_tokens=4)["answers"]
print("answers:", answers)
