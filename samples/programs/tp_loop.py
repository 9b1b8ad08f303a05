"""A greedy loop under tensor parallelism: run it with `torchrun --nproc-per-node 2 tp_loop.py MODEL_DIR`.
Each rank holds half of every layer's KV heads (`tp_plan="auto"`: gloo on CPU, NCCL on GPUs); the tokens
are the same on every rank, and only rank 0 prints them. The tokenizer's own specials stay (the prompt
comes from the chat template, tokenized as it renders).

Run:  kvtui watch --headless --trace tp.jsonl -- torchrun --nproc-per-node 2 samples/programs/tp_loop.py MODEL_DIR
kvtui-model: tiny:llama
kvtui-expects: nothing
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1]
NEW_TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 8


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    # Sharded only under torchrun: run alone, transformers 5.x loads the whole model, but 4.57 refuses
    # tp_plan="auto" without torch.distributed (OSError), so alone it loads the model whole here too.
    tp_plan = "auto" if "WORLD_SIZE" in os.environ else None
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, tp_plan=tp_plan)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    cache = DynamicCache(config=model.config)
    out_ids = []
    with torch.inference_mode():
        token = ids
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            out_ids.append(int(token))
    if int(os.environ.get("RANK", "0")) == 0:
        print("tokens:", out_ids)
        print("cache:", cache.get_seq_length(), "tokens,", tuple(cache.layers[0].keys.shape), "per rank")


main()  # the sharded model and its cache are freed here, before the process group they were sharded over
if torch.distributed.is_initialized():
    torch.distributed.barrier()  # every rank done before any tears down (gloo's threads can abort a late one)
    torch.distributed.destroy_process_group()
