"""A GGUF's embedded tokenizer as a ``tokenizers`` ``tokenizer.json`` plus ``tokenizer_config.json``.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is converted. The GGUF
holds the vocabulary, merges, token types and special ids but not the text
splitting rule; ``tokenizer.ggml.pre`` names it, and each name maps to the
pre-tokenizer llama.cpp runs for it. SmolLM's ("smollm") splits every digit
apart before GPT-2's regex, which is also what the upstream tokenizer.json does;
plain GPT-2 splitting would encode " 2024" differently.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from specdec.hub.errors import UnsupportedModelError
from specdec.hub.gguf_weights import field, string_array

CONTROL = 3
USER_DEFINED = 4

_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("gpt2", "default", "mpt", "olmo", "jais")

END_OF_GENERATION_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>"}
)
"""Control tokens that end a generation besides the GGUF's EOS (llama.cpp treats these texts the same way)."""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte-to-printable-character table (the alphabet of a byte-level vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    raise UnsupportedModelError(
        f"GGUF tokenizer.ggml.pre is {pre!r}; supported: {', '.join(sorted((*_DIGITS_THEN_GPT2, *_GPT2)))}"
    )


def convert_tokenizer(reader: GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and an HF-style ``tokenizer_config.json`` (chat template, special tokens, stop ids)."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens = string_array(reader, "tokenizer.ggml.tokens")
    merges = string_array(reader, "tokenizer.ggml.merges")
    types = [int(t) for t in field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(types) != len(tokens):
        raise UnsupportedModelError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A byte-level vocabulary spells every token in the byte alphabet; respell any that is not (as HF does).
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    if len(vocab) != len(tokens):
        raise UnsupportedModelError(f"GGUF vocabulary has duplicate tokens ({len(tokens) - len(vocab)})")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise UnsupportedModelError(f"GGUF merge {merge!r} is not two tokens separated by one space")
        pairs.append((left, right))

    add_prefix_space = bool(field(reader, "tokenizer.ggml.add_space_prefix", False))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(field(reader, "tokenizer.ggml.pre", "default")), add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    )

    def token_of(key: str) -> str | None:
        index = field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise UnsupportedModelError(f"GGUF {key} token id {index} is outside the vocabulary of {len(tokens)}")
        return tokens[int(index)]

    bos, eos = token_of("bos"), token_of("eos")
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise UnsupportedModelError("the GGUF asks to add a BOS/EOS token it does not define")
    if add_bos or add_eos:
        ends = [(t, vocab[t]) for t in (bos if add_bos else None, eos if add_eos else None) if t is not None]
        single = " ".join([*([f"{bos}"] if add_bos else []), "$A", *([f"{eos}"] if add_eos else [])])
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=ends)
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    stop = [vocab[eos]] if eos is not None else []
    for key in ("eot", "eom"):
        extra = token_of(key)
        if extra is not None:
            stop.append(vocab[extra])
    stop += [i for i, t in enumerate(types) if t == CONTROL and tokens[i] in END_OF_GENERATION_TEXTS]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token_of("padding"),
        "unk_token": token_of("unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(field(reader, "llama.context_length", 2048)),
        "chat_template": field(reader, "tokenizer.chat_template", None),
        "stop_token_ids": list(dict.fromkeys(stop)),
    }
    return tokenizer, config
