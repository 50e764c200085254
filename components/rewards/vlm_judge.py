"""VLM-as-judge (docs/ALGORITHM.md section 8): an OpenAI-compatible chat endpoint (vLLM in production) sees
each image as a PNG data URL plus a question, and its reply becomes the reward.

Modes:
- ``yes_no``: one token with its top logprobs; the score is ``sigmoid(logprob(Yes) - logprob(No))``.
- ``score``: the first number in the reply, normalised from ``[score_min, score_max]`` to [0, 1].
- ``ocr``: the reply is a transcription, scored with the ``ocr`` reward's text formula.

With ``with_inputs`` the judge scores an edit (instruction following): each request carries the sample's
input image(s) first, then the result, then the question, and the reward asks for inputs (``inputs = True``).

Each sample is its own request: a failing request (after retries where retrying can help) fails only
its sample, recorded in ``RewardOutput.errors`` with a NaN score.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from components import environ
from components.rewards.arguments import DEFAULT_MAX_TOKENS, VLMJudgeArgs
from components.rewards.base import Inputs, Reward, RewardOutput, SampleError, describe
from components.rewards.codec import encode_png_b64
from components.rewards.http_retry import EXCERPT, RetriesExhausted, send_with_retries
from components.rewards.text_match import ocr_score, target_text

# vLLM's default --max-logprobs; asking for more is a 400 there.
TOP_LOGPROBS = 20
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_EXCERPT = EXCERPT


class JudgeError(Exception):
    """One sample's request or reply could not be turned into a score."""


# The images come in the order the question names them: the input(s), then the result last.
_EDIT = 'The last image is the result of editing the image(s) before it with the instruction "{prompt}". '


def default_question(mode: str, score_min: float = 0.0, score_max: float = 10.0, with_inputs: bool = False) -> str:
    """The question template used when none is configured (``with_inputs``: the one for edits)."""
    if with_inputs and mode == "yes_no":
        return _EDIT + "Was the instruction followed, with nothing else changed? Answer Yes or No."
    if with_inputs:
        return (_EDIT + f"How well was the instruction followed, with nothing else changed? Rate it from "
                f"{score_min:g} (not at all) to {score_max:g} (perfectly). Reply with the number only.")
    if mode == "yes_no":
        return 'Does this image match the description "{prompt}"? Answer Yes or No.'
    if mode == "score":
        return (f'How well does this image match the description "{{prompt}}"? Rate it from {score_min:g} '
                f"(not at all) to {score_max:g} (perfectly). Reply with the number only.")
    return "Transcribe all the text in this image exactly. Reply with the text only."


def png_data_url(image: np.ndarray) -> str:
    """A ``data:image/png;base64,...`` URL of a uint8 (H, W, 3) image."""
    return "data:image/png;base64," + encode_png_b64(np.asarray(image, dtype=np.uint8))


def _token_text(entry: dict[str, Any]) -> str:
    # A byte-level piece that is not valid UTF-8 on its own comes back as token "". vLLM then sends
    # bytes [] too (such a piece can be neither Yes nor No, so it just never matches); servers that
    # send the raw bytes let us read the token from them.
    token = entry.get("token") or ""
    raw = entry.get("bytes")
    if not token and raw:
        token = bytes(raw).decode("utf-8", errors="replace")
    return token


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def yes_no_probability(top_logprobs: list[dict[str, Any]]) -> float:
    """``sigmoid(logprob(Yes) - logprob(No))`` from one position's top logprobs.

    Tokens match case-insensitively after stripping whitespace ("Yes", " yes", "YES" are all Yes); the
    variants' probabilities are summed (logsumexp). When only one side appears, the other's logprob is
    taken as the lowest logprob in the list: an upper bound on it (it ranked below every listed token),
    so the score is pulled toward 0.5 rather than overstated. Neither side listed raises ``JudgeError``.
    """
    sides: dict[str, list[float]] = {"yes": [], "no": []}
    for entry in top_logprobs:
        word = _token_text(entry).strip().casefold()
        if word in sides:
            sides[word].append(float(entry["logprob"]))
    if not sides["yes"] and not sides["no"]:
        listed = [_token_text(e) for e in top_logprobs]
        raise JudgeError(f"neither Yes nor No among the top logprobs {listed!r}")
    floor = min(float(e["logprob"]) for e in top_logprobs)
    yes, no = (_logsumexp(v) if v else floor for v in (sides["yes"], sides["no"]))
    return _sigmoid(yes - no)


def parse_score(reply: str, score_min: float, score_max: float) -> float:
    """The first number in ``reply`` mapped from ``[score_min, score_max]`` to [0, 1]; ``JudgeError`` when
    there is none or it is out of range."""
    match = _NUMBER.search(reply)
    if match is None:
        raise JudgeError(f"no number in reply {reply[:_EXCERPT]!r}")
    value = float(match.group())
    if not score_min <= value <= score_max:
        raise JudgeError(f"score {value:g} outside [{score_min:g}, {score_max:g}] in reply {reply[:_EXCERPT]!r}")
    return (value - score_min) / (score_max - score_min)


def _first_choice(response: Any) -> tuple[dict[str, Any], str]:
    """The first choice of a chat-completions response and its text ("" when the content is null)."""
    try:
        choice = response["choices"][0]
        return choice, choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise JudgeError(f"malformed chat-completions response {str(response)[:_EXCERPT]!r}") from exc


def _run(coro: Any) -> Any:
    """``asyncio.run`` the coroutine, in a helper thread when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-judge") as pool:
        return pool.submit(asyncio.run, coro).result()


class VLMJudge(Reward):
    """Scores images by asking a vision-language model behind an OpenAI-compatible chat endpoint. Arguments:
    ``VLMJudgeArgs``; the API key is read from ``api_key_env`` at each call, so it is never in config nor in the
    (picklable) reward object."""

    name = "vlm_judge"
    Args = VLMJudgeArgs

    def __init__(self, args: VLMJudgeArgs) -> None:
        self.base_url = args.base_url.rstrip("/")
        self.model = args.model
        self.mode = args.mode
        # Per instance, shadowing Reward.inputs: scoring and the reward server read it from the reward object.
        self.inputs = args.with_inputs
        self.question = default_question(args.mode, args.score_min, args.score_max, args.with_inputs) \
            if args.question is None else args.question
        self.score_min, self.score_max = args.score_min, args.score_max
        self.max_tokens = 1 if args.mode == "yes_no" else (
            DEFAULT_MAX_TOKENS[args.mode] if args.max_tokens is None else args.max_tokens)
        self.api_key_env = args.api_key_env
        self.max_concurrency = args.max_concurrency
        self.retries = args.retries
        self.timeout_s, self.backoff_s = args.timeout_s, args.backoff_s

    def request_body(self, image: np.ndarray, prompt: str, inputs: Sequence[np.ndarray] = ()) -> dict[str, Any]:
        """The chat-completions request sent for one sample: its input images (edits), the image, the question."""
        content = [{"type": "image_url", "image_url": {"url": png_data_url(picture)}} for picture in (*inputs, image)]
        content.append({"type": "text", "text": self.question.format(prompt=prompt)})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        if self.mode == "yes_no":
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        return body

    def _score(self, choice: dict[str, Any], text: str, prompt: str, metadata: dict[str, Any]) -> float:
        if self.mode == "yes_no":
            try:
                top = choice["logprobs"]["content"][0]["top_logprobs"]
            except (KeyError, IndexError, TypeError) as exc:
                raise JudgeError(f"response has no top logprobs: {str(choice)[:_EXCERPT]!r}") from exc
            if not top:
                raise JudgeError("response has an empty top_logprobs list")
            return yes_no_probability(top)
        if self.mode == "score":
            return parse_score(text, self.score_min, self.score_max)
        return ocr_score(text, target_text(prompt, metadata))

    async def _post(self, client: httpx.AsyncClient, limit: asyncio.Semaphore, body: dict[str, Any]) -> dict:
        try:
            response = await send_with_retries(lambda: client.post("chat/completions", json=body),
                                               retries=self.retries, backoff_s=self.backoff_s,
                                               timeout_s=self.timeout_s, limit=limit)
        except RetriesExhausted as exc:
            raise JudgeError(str(exc)) from exc
        if response.status_code != 200:
            raise JudgeError(f"HTTP {response.status_code}: {response.text[:_EXCERPT]}")
        try:
            return response.json()
        except ValueError as exc:
            raise JudgeError(f"response is not JSON: {response.text[:_EXCERPT]!r}") from exc

    async def _score_all(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                         inputs: Inputs) -> list[tuple[float, str | None, str | None]]:
        limit = asyncio.Semaphore(self.max_concurrency)
        key = environ.judge_key(self.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        pool = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)

        async def one(image: np.ndarray, prompt: str, meta: dict[str, Any],
                      given: list[np.ndarray]) -> tuple[float, str | None, str | None]:
            text = None  # kept when the reply came back but could not be scored, to show what it was
            try:
                if self.inputs and not given:
                    raise SampleError("inputs", "vlm_judge with_inputs judges an edit against its input image(s), but "
                                                "this sample came with none (give the dataset rows `images`)")
                body = self.request_body(image, prompt, given)
                choice, text = _first_choice(await self._post(client, limit, body))
                return self._score(choice, text, prompt, meta), text, None
            except SampleError as exc:
                return math.nan, text, describe(exc)
            except Exception as exc:  # a judge failure is data, recorded per sample
                message = str(exc) if isinstance(exc, JudgeError) else f"{type(exc).__name__}: {exc}"
                return math.nan, text, f"vlm_judge: {message}"

        # asyncio.timeout in _post bounds each attempt; httpx's own timeout is only a backstop.
        async with httpx.AsyncClient(base_url=self.base_url + "/", headers=headers, limits=pool,
                                     timeout=self.timeout_s + 1) as client:
            return await asyncio.gather(*(one(*sample) for sample in zip(images, prompts, metadata, inputs,
                                                                           strict=True)))

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                 inputs: Inputs | None = None) -> RewardOutput:
        """Scores per sample; ``inputs`` (each sample's input images) are sent only ``with_inputs``, where a
        sample without any fails alone."""
        counts = {"images": len(images), "prompts": len(prompts), "metadata entries": len(metadata)}
        if inputs is not None:
            counts["input lists"] = len(inputs)
        if len(set(counts.values())) > 1:
            raise ValueError(f"vlm_judge: {', '.join(f'{n} {what}' for what, n in counts.items())}; expected one "
                             "of each per sample")
        given = inputs if self.inputs and inputs is not None else [[] for _ in range(len(images))]
        results = _run(self._score_all(images, prompts, metadata, given))
        out = RewardOutput.from_scores([score for score, _, _ in results], extra={"reply": [r for _, r, _ in results]})
        out.errors = [error or other for (_, _, error), other in zip(results, out.errors, strict=True)]
        return out
