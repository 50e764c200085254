"""Character-level CLIP and T5 tokenizers built in memory, so the tiny model needs no files or hub.

CLIP: the byte-to-unicode alphabet of CLIP's BPE with no merges, so every word is
spelt out character by character. T5: a unigram vocabulary of single characters
with and without the word-start marker. Both are deterministic and tiny.
"""

from __future__ import annotations

from functools import cache

from transformers import CLIPTokenizer, T5Tokenizer

CLIP_MAX_LENGTH = 77


@cache
def _byte_alphabet() -> tuple[str, ...]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


def clip_tokenizer() -> CLIPTokenizer:
    alphabet = _byte_alphabet()
    tokens = list(alphabet) + [c + "</w>" for c in alphabet] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def clip_vocab_size() -> int:
    return 2 * len(_byte_alphabet()) + 2


def t5_tokenizer(max_length: int) -> T5Tokenizer:
    chars = [chr(c) for c in range(32, 127)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def t5_vocab_size() -> int:
    return 4 + 2 * (127 - 32)
