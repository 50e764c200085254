"""VLMJudge's normal code path against a real vLLM OpenAI server on CPU (tiny rigged Qwen2-VL, see
tiny_qwen2vl.py). Each score is checked against the formula applied to what the server itself returns
for the judge's exact request, fetched separately."""

from __future__ import annotations

import math
import re

import httpx
import numpy as np
import pytest
from tiny_qwen2vl import NO_TOKEN, REPLY, YES_TOKEN

from components.rewards.arguments import VLMJudgeArgs
from components.rewards.text_match import ocr_score, target_text
from components.rewards.vlm_judge import VLMJudge

pytestmark = pytest.mark.vllm

PROMPTS = ["a red cube on a table", 'a sign that says "Yes 7"', "a photo of a dog"]


def images(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(n, 64, 64, 3), dtype=np.uint8)


def judge(server, **args) -> VLMJudge:
    return VLMJudge(VLMJudgeArgs(base_url=server.base_url, model=server.model, timeout_s=120, max_concurrency=2,
                                 **args))


@pytest.mark.slow
def test_server_lists_the_tiny_model(vllm_server):
    listing = httpx.get(f"{vllm_server.base_url}/models", timeout=30).json()
    assert [m["id"] for m in listing["data"]] == [vllm_server.model]


def test_yes_no_is_a_probability_from_the_returned_logprobs_and_deterministic(vllm_server):
    reward = judge(vllm_server, mode="yes_no")
    batch = images(3)
    first = reward(batch, PROMPTS, [{}] * 3)
    second = reward(batch, PROMPTS, [{}] * 3)
    assert first.errors == [None] * 3, first.errors
    assert first.extra["reply"] == [YES_TOKEN] * 3
    np.testing.assert_allclose(first.scores, second.scores, rtol=0, atol=1e-6)

    for i, prompt in enumerate(PROMPTS):
        raw = vllm_server.chat(reward.request_body(batch[i], prompt))
        top = raw["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        assert len(top) == 20 and all(e["logprob"] <= 0 for e in top)
        # The rig: Yes first, " no" second, every other token far behind.
        assert [top[0]["token"], top[1]["token"]] == [YES_TOKEN, NO_TOKEN]
        assert top[1]["logprob"] - top[2]["logprob"] > 5
        yes = sum(math.exp(e["logprob"]) for e in top if e["token"].strip().lower() == "yes")
        no = sum(math.exp(e["logprob"]) for e in top if e["token"].strip().lower() == "no")
        expected = yes / (yes + no)
        assert 0.5 < expected < 1
        assert first.scores[i] == pytest.approx(expected, abs=1e-5)


def _first_number(text: str) -> float | None:
    match = re.search(r"-?\d+(?:\.\d+)?", text)
    return float(match.group()) if match else None


@pytest.mark.parametrize(("score_max", "parses"), [(10, True), (5, False)])
def test_score_mode_parses_the_reply_the_server_gives(vllm_server, score_max, parses):
    reward = judge(vllm_server, mode="score", score_min=0, score_max=score_max)
    batch = images(2)
    out = reward(batch, PROMPTS[:2], [{}] * 2)
    for i, prompt in enumerate(PROMPTS[:2]):
        reply = vllm_server.chat(reward.request_body(batch[i], prompt))["choices"][0]["message"]["content"]
        assert out.extra["reply"][i] == reply == REPLY
        number = _first_number(reply)
        if number is not None and 0 <= number <= score_max:
            assert out.errors[i] is None and out.scores[i] == pytest.approx(number / score_max)
        else:
            assert np.isnan(out.scores[i]) and f"outside [0, {score_max}]" in out.errors[i]
    assert parses == (out.failed == 0)


def test_ocr_mode_scores_the_transcription_with_the_ocr_formula(vllm_server):
    reward = judge(vllm_server, mode="ocr")
    batch = images(3)
    metadata = [{}, {}, {"ground_truth": "yes7"}]
    out = reward(batch, PROMPTS, metadata)
    assert out.failed == 0, out.errors
    for i, (prompt, meta) in enumerate(zip(PROMPTS, metadata, strict=True)):
        reply = vllm_server.chat(reward.request_body(batch[i], prompt))["choices"][0]["message"]["content"]
        assert out.extra["reply"][i] == reply
        assert out.scores[i] == pytest.approx(ocr_score(reply, target_text(prompt, meta)))
    # The rigged reply "Yes7" contains the target "Yes 7" / "yes7" once whitespace and case are normalised.
    assert out.scores[1] == out.scores[2] == 1.0
    assert out.scores[0] == 0.0  # no quoted target: an empty target with text recognised


def test_unknown_model_fails_each_sample_without_retrying(vllm_server):
    reward = VLMJudge(VLMJudgeArgs(base_url=vllm_server.base_url, model="no-such-model", timeout_s=60, retries=3))
    out = reward(images(2), PROMPTS[:2], [{}] * 2)
    assert all(e is not None and "HTTP 404" in e and "gave up" not in e for e in out.errors), out.errors


def test_the_editing_judge_sends_input_and_result_and_scores_each_edit(vllm_server):
    reward = judge(vllm_server, mode="yes_no", with_inputs=True)
    results = images(2)
    rng = np.random.default_rng(1)
    # The input is larger than the result (64 x 64) so that its image tokens differ from the result's.
    inputs = [[rng.integers(0, 256, size=(84, 112, 3), dtype=np.uint8)] for _ in range(2)]
    prompts = ["make the cube blue", "remove the dog"]
    out = reward(results, prompts, [{}, {}], inputs=inputs)
    assert out.errors == [None, None], out.errors
    assert out.extra["reply"] == [YES_TOKEN] * 2
    for i, prompt in enumerate(prompts):
        raw = vllm_server.chat(reward.request_body(results[i], prompt, inputs[i]))
        top = raw["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        yes = sum(math.exp(e["logprob"]) for e in top if e["token"].strip().lower() == "yes")
        no = sum(math.exp(e["logprob"]) for e in top if e["token"].strip().lower() == "no")
        assert math.isfinite(out.scores[i]) and out.scores[i] == pytest.approx(yes / (yes + no), abs=1e-5)

    # The server took both images: the prompt's token count is the text's plus the input's plus the result's.
    body = reward.request_body(results[0], prompts[0], inputs[0])
    given, result, question = body["messages"][0]["content"]

    def prompt_tokens(*parts: dict) -> int:
        reply = vllm_server.chat({**body, "messages": [{"role": "user", "content": [*parts, question]}]})
        return reply["usage"]["prompt_tokens"]

    text = prompt_tokens()
    alone = {"input": prompt_tokens(given) - text, "result": prompt_tokens(result) - text}
    assert alone["input"] > alone["result"] > 0, alone
    assert prompt_tokens(given, result) - text == alone["input"] + alone["result"]

    # One input more (3 images) is over the server's limit of 2: that sample fails alone, with vLLM's reason.
    over = reward(results, prompts, [{}, {}], inputs=[[inputs[0][0], inputs[1][0]], inputs[1]])
    assert np.isnan(over.scores[0]) and "HTTP 400" in over.errors[0] and "At most 2 image" in over.errors[0], \
        over.errors
    assert over.errors[1] is None and over.scores[1] == pytest.approx(out.scores[1], abs=1e-6)
