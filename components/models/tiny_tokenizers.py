"""Tokenizers built in memory, so the tiny models need no files or hub: character-level CLIP and T5, and a
small byte-level BPE for Qwen.

CLIP: the byte-to-unicode alphabet of CLIP's BPE with no merges, so every word is
spelt out character by character. T5: a unigram vocabulary of single characters
with and without the word-start marker. Both are deterministic and tiny.
"""

from __future__ import annotations

from functools import cache

from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

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


def _word_merges(words: tuple[str, ...]) -> list[tuple[str, str]]:
    """BPE merges that build each word left to right ("r"+"e", "re"+"d</w>"), so a listed word is one token."""
    merges: list[tuple[str, str]] = []
    for word in sorted(words, key=len, reverse=True):  # "g"+"r" of green outranks "r"+"e" of red
        pieces = [*word[:-1], word[-1] + "</w>"]
        for i in range(1, len(pieces)):
            merge = ("".join(pieces[:i]), pieces[i])
            if merge not in merges:
                merges.append(merge)
    return merges


def clip_tokenizer(max_length: int = CLIP_MAX_LENGTH, words: tuple[str, ...] = ()) -> CLIPTokenizer:
    """Character level; each of ``words`` (lower-case ASCII) becomes a single token."""
    alphabet = _byte_alphabet()
    merges = _word_merges(words)
    tokens = list(alphabet) + [c + "</w>" for c in alphabet] + ["<|startoftext|>", "<|endoftext|>"]
    tokens += ["".join(m) for m in merges]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def clip_vocab_size(words: tuple[str, ...] = ()) -> int:
    return 2 * len(_byte_alphabet()) + 2 + len(_word_merges(words))


def clip_bos_eos() -> tuple[int, int]:
    """Ids of <|startoftext|> and <|endoftext|> (the word tokens come after them)."""
    return 2 * len(_byte_alphabet()), 2 * len(_byte_alphabet()) + 1


def t5_tokenizer(max_length: int, words: tuple[str, ...] = ()) -> T5Tokenizer:
    """Character level; each of ``words`` is one piece (it outscores its letters in the unigram model)."""
    chars = [chr(c) for c in range(32, 127)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    pieces += [("▁" + w, -1.0) for w in words]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def t5_vocab_size(words: tuple[str, ...] = ()) -> int:
    return 4 + 2 * (127 - 32) + len(words)


# The Qwen chat-format special tokens (Qwen2-VL / Qwen2.5-VL share them).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)


def qwen_tokenizer(corpus: tuple[str, ...], vocab_size: int) -> Qwen2Tokenizer:
    """A byte-level BPE trained on ``corpus`` with the Qwen special tokens, as a ``Qwen2Tokenizer``.

    Words frequent in the corpus become single tokens, as in the real vocabulary; anything else falls
    back to bytes, so every text is encodable. Also loaded by file path from tests/vllm (no package there).
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(list(corpus) * 20, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained]
    tokenizer = Qwen2Tokenizer(vocab=bpe.get_vocab(), merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=1024)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    return tokenizer
