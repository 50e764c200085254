"""Build a tiny random Qwen2-VL offline (model, byte-level BPE tokenizer, image and video processors, chat
template) that vLLM can serve on CPU; nothing comes from a hub.

Text model: hidden 128, 2 layers; vision tower: depth 1. Random weights answer arbitrarily, so a few
embedding channels are rigged to make the greedy reply a fixed chain, whatever the image and question:

    end of the prompt -> "Yes" (with " no" a fixed margin behind) -> "7" -> <|im_end|>

Channel k of the embedding of the chain's k-th token is set high, so it dominates that position's final
hidden state (after the RMSNorm), and the lm_head row of the next token reads that channel. The first
token's top logprobs are then stable (Yes first, " no" second), the full reply is ``REPLY``, and the
other top-logprob tokens stay far below.

Run as a script with the python of the vLLM venv (so the files match the transformers that serves them):
``python tiny_qwen2vl.py OUT_DIR``. Only the constants are imported by the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

SERVED_NAME = "tiny-qwen2vl"
YES_TOKEN, NO_TOKEN, DIGIT_TOKEN = "Yes", " no", "7"
REPLY = YES_TOKEN + DIGIT_TOKEN
HIDDEN = 128
SPIKE = 1.0  # vs. N(0, 0.02) initial weights: one channel carries nearly all of the hidden state's norm
# lm_head weights on the spiked channel: after the RMSNorm the channel is about sqrt(HIDDEN) = 11.3,
# so "Yes" leads " no" by about 11.3 * 0.2 = 2.3 nats, and both lead every other token by about 10.
LEAD, NO_MARGIN = 1.0, 0.2

# Qwen2-VL's chat template.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "You are a helpful assistant.",
    "Does this image match the description? Answer Yes or no.",
    "Yes, it does. No, it does not. Yes or no? yes no Yes no YES NO",
    "How well does this image match the description? Rate it from 0 to 10. Reply with the number only.",
    "Transcribe all the text in this image exactly. Reply with the text only.",
    "A red cube on a table. A sign that says open late. A photo of a dog.",
]


def _tiny_tokenizers():
    """The project's tokenizer builders, loaded by file path: the vLLM venv has no flowgrpo package."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "components" / "models" / "tiny_tokenizers.py"
    spec = importlib.util.spec_from_file_location("tiny_tokenizers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tokenizer():
    """A byte-level BPE trained on ``CORPUS`` with the Qwen special tokens and the Qwen2-VL chat template."""
    tokenizer = _tiny_tokenizers().qwen_tokenizer(tuple(CORPUS), vocab_size=400)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _single_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"{text!r} is {len(ids)} tokens in the tiny vocabulary, the chain needs one")
    return ids[0]


def build(out: Path) -> Path:
    """Write the model, tokenizer, processors and generation config to ``out``; return it."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _tiny_tokenizers().QWEN_SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": HIDDEN, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": HIDDEN, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2VLForConditionalGeneration(config).eval()

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                           tokenize=False)
    prompt_end = tokenizer.encode(prompt, add_special_tokens=False)
    yes, no, digit = (_single_id(tokenizer, t) for t in (YES_TOKEN, NO_TOKEN, DIGIT_TOKEN))
    chain = [(prompt_end[-1], {yes: LEAD, no: LEAD - NO_MARGIN}), (yes, {digit: LEAD}),
             (digit, {ids["<|im_end|>"]: LEAD})]
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for channel, (token, next_rows) in enumerate(chain):
            embed[token, channel] = SPIKE
            head[:, channel] = 0.0
            for row, weight in next_rows.items():
                head[row, channel] = weight

    model.save_pretrained(out)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=Qwen2VLVideoProcessor(),
                                 tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
                     do_sample=False).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
