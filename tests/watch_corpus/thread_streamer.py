"""The docs' streaming recipe: generate() runs in a threading.Thread (target=model.generate with
kwargs) while the main thread reads a TextIteratorStreamer.

kvtui-model: tiny:qwen2
kvtui-expects: nothing
"""

import sys
from threading import Thread

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

inputs = tokenizer(["Once upon a time, a small cat"], return_tensors="pt")
streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
generation_kwargs = dict(inputs, streamer=streamer, max_new_tokens=8, do_sample=False)
thread = Thread(target=model.generate, kwargs=generation_kwargs)
thread.start()
pieces = [new_text for new_text in streamer]
thread.join()
print("pieces:", len(pieces))
print("text:", repr("".join(pieces)))
