"""kvpress's pipeline with KeyRerotationPress: the kept keys are re-rotated to the positions of their slots
(0..kept-1), and the pipeline answers each question from the compressed length (`context_length =
cache.get_seq_length()` for this press), which is right for re-rotated keys. kvtui reads the re-rotation from the
keys (values kept as written, keys rotated to their slots) and raises nothing.

kvtui-model: tiny:llama
kvtui-expects: cache-evicted
kvtui-press: KeyRerotationPress(press=KnormPress(compression_ratio=0.5))
"""

import sys

import torch
from kvpress import KeyRerotationPress, KnormPress
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
context = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
press = KeyRerotationPress(press=KnormPress(compression_ratio=0.5))
answers = pipe(context, questions=["the fox", "the dog"], press=press, max_new_tokens=4)["answers"]
print("answers:", answers)
