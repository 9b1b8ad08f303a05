"""The tiny models' tokenizers: a byte-level BPE trained on a fixed corpus (so the vocab is reproducible),
post-processed to add BOS/EOS the way the family's tokenizer does, saved so 4.x and 5.x load it alike."""

from __future__ import annotations

import json
from pathlib import Path

from .tiny_arches import ArchSpec

VOCAB_TARGET = 512

# Fixed training corpus: the tokenizer (and so the vocab size) must be reproducible.
CORPUS = [
    "Let's start by defining a variable k equal to 5. What is k?",
    "The variable k is equal to 5.",
    "Now multiply k by 3. What is k multiplied by 3?",
    "k multiplied by 3 is equal to 15.",
    "What is 12 plus 30? The answer is 42.",
    "Define a variable x equal to 7, and a variable y equal to 9.",
    "What is x multiplied by y? It is 63.",
    "Is 100 divided by 4 equal to 25? Yes, it is.",
    "Hello! How are you today?",
    "I am fine, thank you. How can I help you?",
    "Please tell me a short story about a cat.",
    "Once upon a time, a small cat lived in a quiet house.",
    "The cat liked to sleep in the sun, near the window.",
    "What is the capital of France? The capital of France is Paris.",
    "Count from 0 to 9: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9.",
    "The year 2024 had 366 days; the year 2023 had 365.",
    "You are a helpful assistant.",
    "Answer the question, then explain your reasoning step by step.",
    "A key and a value are stored for every token in the cache.",
    "The attention layer reads the keys and values of earlier tokens.",
    "Sliding window attention only keeps the most recent tokens.",
    "Summarize the text above in one sentence, please.",
    "def add(a, b): return a + b  # a simple function",
    "print(\"hello world\")  [1, 2, 3] {'k': 5} (x + y) * 2 = z",
    "Email me at test@example.com or call 555-0123 at 10:30 am.",
    "Prices went up by 3.5% in March, and by 2.1% in April.",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "What is k plus k? It is 10, since k is equal to 5.",
    "Now set k equal to k multiplied by k. What is k now?",
    "k is now equal to 25.",
    "Thanks! That was very helpful. Goodbye.",
    "The quick brown fox jumps over the lazy dog.",
    'She said: "I will be there at 8 o\'clock, I promise."',
    "Is it true that 2 + 2 = 4? Yes; it is always true.",
    "Write a list: first, second, third, and last.",
    "Remember the variable k. We will use it again later.",
]


def build_tokenizer(spec: ArchSpec, *, add_bos: bool, add_eos: bool, template: str, byte_fallback: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if byte_fallback:
        backend = _byte_fallback_backend(spec)
    elif spec.pretokenize_regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.pretokenize_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if not byte_fallback:
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_TARGET,
            special_tokens=list(spec.specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
            show_progress=False,
        )
        backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.post_processor = _post_processor(backend, spec, add_bos=add_bos, add_eos=add_eos)

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        unk_token=spec.unk,
        # Recorded so transformers 5.x, which rebuilds the post-processor from these
        # flags when they are present, agrees with the one set above.
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        # Decoder-only models take no token_type_ids; 4.57 returns them unless told the model's inputs.
        model_input_names=["input_ids", "attention_mask"],
    )
    tok.chat_template = template
    return tok


def _byte_fallback_backend(spec: ArchSpec):
    """A SentencePiece-style BPE (Llama 2, Mistral, Gemma): '▁' for a space, and a character outside the trained
    vocab written as its UTF-8 bytes, one `<0xE4>` token each (byte fallback). Trained on the corpus (its
    characters only: 你, é outside it become bytes), then rebuilt with the 256 byte tokens in the model's vocab,
    where byte fallback looks for them. Its decoder keeps the first space (no Strip): decode() is the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def metaspace():
        return pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")

    trained = Tokenizer(models.BPE(unk_token=spec.unk or spec.specials[0]))
    trained.pre_tokenizer = metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET - 256, special_tokens=list(spec.specials), show_progress=False
    )
    trained.train_from_iterator(CORPUS, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(spec.specials)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = [
        (m.split(" ")[0], m.split(" ")[1]) if isinstance(m, str) else (m[0], m[1]) for m in model["merges"]
    ]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=spec.unk, byte_fallback=True))
    backend.add_special_tokens(list(spec.specials))
    backend.pre_tokenizer = metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _post_processor(backend, spec: ArchSpec, *, add_bos: bool, add_eos: bool):
    """TemplateProcessing in the same shape transformers' own update_post_processor writes."""
    from tokenizers import processors

    def side(type_id: int, part: str) -> str:
        pieces = [f"{spec.bos}:{type_id}"] if add_bos else []
        pieces.append(f"{part}:{type_id}")
        if add_eos:
            pieces.append(f"{spec.eos}:{type_id}")
        return " ".join(pieces)

    used = dict.fromkeys(([spec.bos] if add_bos else []) + ([spec.eos] if add_eos else []))
    return processors.TemplateProcessing(
        single=side(0, "$A"),
        pair=f"{side(0, '$A')} {side(1, '$B')}",
        special_tokens=[(t, backend.token_to_id(t)) for t in used],  # deduped: gpt2 bos == eos
    )


def save_tokenizer(tok, out: Path) -> None:
    tok.save_pretrained(out)
    # transformers 5.x records "TokenizersBackend", a class 4.x does not know; the
    # 4.x name still resolves to the same generic tokenizer on 5.x.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
