"""Continuous batching: generate_batch over chat prompts that share a long system prompt, as the docs show it.

Its prompts are tokenized in one batch, so the third one differs from the others at its first token; the
fourth is the second asked again after the first batch finished: its whole prompt was held by a finished
request of the first batch, and block sharing is off in the second batch (a planted prefix miss).

kvtui-model: tiny:llama
kvtui-expects: recomputed-prefix
kvtui-expects-if-continuous-batching-is-missing: nothing
kvtui-exit-if-continuous-batching-is-missing: 1

Where transformers has no continuous batching for the CPU (4.57: no ContinuousBatchingConfig), its import fails
before any forward (exit 1), watched or not.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

MODEL = sys.argv[1]
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")

SYSTEM = "You are a helpful assistant who answers briefly, politely and always in plain English."
QUESTIONS = ["What is a cache?", "Why do positions matter?", "Name a color."]
prompts = [
    tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    for question in QUESTIONS
]
prompts[2] = [prompts[2][0] + 1] + list(prompts[2][1:])  # a prompt that shares no prefix
generation = GenerationConfig(max_new_tokens=4, do_sample=False)
print("prompt lengths:", [len(prompt) for prompt in prompts])

from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402  (5.x)

# small pages and a small token budget: prefills are split over forwards and requests share blocks
config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=64)
first = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=config)
for request_id in sorted(first):
    print(request_id, "ids:", list(first[request_id].generated_tokens))

# again, in one batch, block sharing off: the second prompt's prefix is re-encoded though the first held it
again = [prompts[0], prompts[1]]
config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=64, allow_block_sharing=False)
second = model.generate_batch(inputs=again, generation_config=generation, continuous_batching_config=config)
for request_id in sorted(second):
    print("again", request_id, "ids:", list(second[request_id].generated_tokens))
print(tokenizer.decode(first[sorted(first)[0]].generated_tokens, skip_special_tokens=True))
