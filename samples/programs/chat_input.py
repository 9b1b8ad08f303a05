"""An interactive chat: reads your lines with input("you> ") until EOF (ctrl+d) or "quit", and keeps one
DynamicCache across the turns. Each turn feeds only what the cache lacks: the end of the last reply's
turn and the new user message, from the template's own text, tokenized without added specials; the reply's
own ids stay in the cache as generated (never re-encoded from text). kvtui raises nothing on it.

Run:  kvtui watch samples/programs/chat_input.py MODEL_DIR   (type in the input line under the output)
Also: kvtui watch --headless samples/programs/chat_input.py MODEL_DIR < lines.txt   (one message a line)
kvtui-model: tiny:llama
kvtui-expects: nothing
kvtui-stdin: hello | how are you?
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODEL = sys.argv[1] if len(sys.argv) > 1 else "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_NEW_TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 12

tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
stop_ids = {tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens)}


def render(messages, generation_prompt):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def reply(new_ids, cache):
    """Prefill new_ids ([1, n]) after what the cache holds, then decode greedily; the stop token is not fed."""
    out = model(input_ids=new_ids, past_key_values=cache, use_cache=True)  # positions from the cache length
    generated = []
    for _ in range(MAX_NEW_TOKENS):
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        if int(token) in stop_ids:
            break
        generated.append(int(token))
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
    return generated


messages = []
cache = DynamicCache(config=model.config)
in_cache = ""  # the text the cache holds: the template's rendering up to the end of the last reply
with torch.no_grad():
    while True:
        try:
            line = input("you> ")
        except EOFError:  # ctrl+d, or the end of piped input
            print()
            break
        if line.strip() == "quit":
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        rendered = render(messages, generation_prompt=True)
        if not messages[:-1]:  # the first turn: the template's ids, BOS as the template writes it
            new_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"]
        elif rendered.startswith(in_cache):  # the rest of the last turn and the new one; nothing added
            new_ids = tokenizer(rendered[len(in_cache):], add_special_tokens=False, return_tensors="pt")["input_ids"]
        else:  # the template re-rendered earlier turns differently: start a fresh cache from the whole chat
            cache = DynamicCache(config=model.config)
            new_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"]
        answer = tokenizer.decode(reply(new_ids, cache), skip_special_tokens=True)
        print(f"bot> {answer}  [cache: {cache.get_seq_length()} tokens]", flush=True)
        messages.append({"role": "assistant", "content": answer})
        in_cache = rendered + answer
print("bye")
