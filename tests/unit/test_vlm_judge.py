"""The VLM judge against a small real HTTP server on 127.0.0.1 speaking OpenAI chat-completions JSON:
scoring math per mode, retries, timeouts, the concurrency bound, argument checks, and the editing judge
(``with_inputs``: input images then the result)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from components import environ
from components.errors import ConfigError
from components.launch.kubernetes import podspec
from components.rewards.arguments import VLMJudgeArgs
from components.rewards.registry import RewardSpec, build_reward
from components.rewards.scoring import call_reward
from components.rewards.text_match import ocr_score
from components.rewards.vlm_judge import VLMJudge
from components.trainer.config import TrainingJobConfig

# A handler gets (request number from 1, request body) and returns (status, JSON-able body or text, delay s).
Handler = Callable[[int, dict[str, Any]], tuple[int, Any, float]]


class FakeOpenAI:
    """A threaded HTTP server that answers POST /v1/chat/completions with whatever ``handler`` says, and
    records the requests, their headers and the most requests it had in flight at once."""

    def __init__(self) -> None:
        self.handler: Handler = lambda n, body: (200, reply("Yes"), 0.0)
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.requests.append(body)
                    fake.headers.append(dict(self.headers))
                    number = len(fake.requests)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if self.path != "/v1/chat/completions":
                        status, payload, delay = 404, {"error": f"no route {self.path}"}, 0.0
                    else:
                        status, payload, delay = fake.handler(number, body)
                    time.sleep(delay)
                    data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and hung up: that is what the test wanted
                finally:
                    with fake._lock:
                        fake.in_flight -= 1

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def reply(content: str, top_logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                              "finish_reason": "stop"}
    if top_logprobs is not None:
        choice["logprobs"] = {"content": [{"token": content, "logprob": top_logprobs[0]["logprob"],
                                           "top_logprobs": top_logprobs}]}
    return {"id": "cmpl-1", "object": "chat.completion", "model": "judge", "choices": [choice]}


def lp(token: str, logprob: float, raw: bytes | None = None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode() if raw is None else raw)}


@pytest.fixture
def server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    yield fake
    fake.close()


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 16, 16, 3), dtype=np.uint8)


def judge(server: FakeOpenAI, **args: Any) -> VLMJudge:
    return VLMJudge(VLMJudgeArgs(base_url=server.base_url, model="judge", **{"backoff_s": 0.01, **args}))


def sigmoid_of(yes_probs: list[float], no_probs: list[float]) -> float:
    # Independent of the implementation: P(yes-like) / (P(yes-like) + P(no-like)).
    return sum(yes_probs) / (sum(yes_probs) + sum(no_probs))


def test_yes_no_is_sigmoid_of_the_logprob_difference_and_the_request_is_openai_vision(server, monkeypatch):
    top = [lp("Yes", -0.4), lp(" no", -1.6), lp("YES", -3.0), lp("maybe", -3.5), lp(" Yes ", -4.0),
           lp("Nope", -5.0)]
    server.handler = lambda n, body: (200, reply("Yes", top), 0.0)
    monkeypatch.setenv("VLM_JUDGE_API_KEY_MINE", "sk-test")
    batch = images(2)
    out = judge(server, api_key_env="VLM_JUDGE_API_KEY_MINE")(batch, ["a red cube", "a dog"], [{}, {}])

    expected = sigmoid_of([math.exp(-0.4), math.exp(-3.0), math.exp(-4.0)], [math.exp(-1.6)])
    assert out.errors == [None, None]
    np.testing.assert_allclose(out.scores, [expected, expected], rtol=1e-12)
    assert out.extra["reply"] == ["Yes", "Yes"]

    assert {h["Authorization"] for h in server.headers} == {"Bearer sk-test"}
    by_prompt = {r["messages"][0]["content"][1]["text"]: r for r in server.requests}
    request = by_prompt['Does this image match the description "a red cube"? Answer Yes or No.']
    assert request["model"] == "judge"
    assert (request["max_tokens"], request["logprobs"], request["top_logprobs"]) == (1, True, 20)
    url = request["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    sent = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    np.testing.assert_array_equal(sent, batch[0])


def test_yes_no_one_side_missing_uses_the_lowest_listed_logprob_and_neither_fails(server):
    top_by_prompt = {
        "only yes": [lp("Yes", -0.2), lp("cat", -2.0), lp("dog", -6.0)],
        "only no": [lp("NO", -0.1), lp("cat", -3.0)],
        "neither": [lp("cat", -0.1), lp("dog", -3.0)],
        "byte token": [lp("", -0.3, raw=b"yes"), lp("\u0120no", -9.0), lp(" No", -1.3), lp("", -9.5, raw=b"")],
    }

    def handle(n, body):
        prompt = body["messages"][0]["content"][1]["text"]
        return 200, reply("x", top_by_prompt[prompt]), 0.0

    server.handler = handle
    prompts = list(top_by_prompt)
    out = judge(server, question="{prompt}")(images(4), prompts, [{}] * 4)

    assert out.scores[0] == pytest.approx(sigmoid_of([math.exp(-0.2)], [math.exp(-6.0)]), rel=1e-12)
    assert out.scores[1] == pytest.approx(sigmoid_of([math.exp(-3.0)], [math.exp(-0.1)]), rel=1e-12)
    assert np.isnan(out.scores[2]) and "neither Yes nor No" in out.errors[2]
    # token "" with bytes b"yes" counts as yes; "" with no bytes (what vLLM sends for a partial UTF-8
    # piece) and "\u0120no" (a raw byte-level piece) match nothing.
    assert out.scores[3] == pytest.approx(sigmoid_of([math.exp(-0.3)], [math.exp(-1.3)]), rel=1e-12)
    assert [e is None for e in out.errors] == [True, True, False, True]


def test_score_mode_parses_the_first_number_and_normalises(server):
    replies = {"a": "Score: 7/10", "b": "  2.5 out of 5, I think 4", "c": "-3", "d": "twelve", "e": "11"}

    def handle(n, body):
        prompt = body["messages"][0]["content"][1]["text"].split("|")[0]
        return 200, reply(replies[prompt]), 0.0

    server.handler = handle
    out = judge(server, mode="score", question="{prompt}|rate 1-11", score_min=1, score_max=11, max_tokens=8)(
        images(5), list(replies), [{}] * 5)

    assert out.scores[:2].tolist() == pytest.approx([(7 - 1) / 10, (2.5 - 1) / 10])
    assert "outside [1, 11]" in out.errors[2] and "no number" in out.errors[3]
    assert out.scores[4] == 1.0 and out.errors[4] is None
    assert out.extra["reply"] == list(replies.values())  # kept for failed parses too, to show what came back
    assert {r["max_tokens"] for r in server.requests} == {8}
    assert all("logprobs" not in r for r in server.requests)


def test_score_mode_default_question_names_the_scale(server):
    server.handler = lambda n, body: (200, reply("0"), 0.0)
    out = judge(server, mode="score", score_min=-50, score_max=50)(images(1), ["a cat"], [{}])
    assert out.scores.tolist() == [0.5]
    text = server.requests[0]["messages"][0]["content"][1]["text"]
    assert '"a cat"' in text and "from -50" in text and "to 50" in text


def test_ocr_mode_matches_text_match(server):
    by_prompt = {'a sign "Open Late"': "OPEN LATE", 'a shop "Open Late"': "opem late",
                 'a blank "Open Late"': "", "no quotes": "Hello"}
    server.handler = lambda n, body: (200, reply(by_prompt[body["messages"][0]["content"][1]["text"]]), 0.0)
    prompts = list(by_prompt)
    metadata = [{}, {}, {}, {"ground_truth": "hello"}]
    out = judge(server, mode="ocr", question="{prompt}")(images(4), prompts, metadata)

    expected = [ocr_score("OPEN LATE", "Open Late"), ocr_score("opem late", "Open Late"), ocr_score("", "Open Late"),
                ocr_score("Hello", "hello")]
    assert out.scores.tolist() == pytest.approx(expected)
    assert expected == pytest.approx([1.0, 1 - 1 / 8, 0.0, 1.0])
    assert out.extra["reply"] == ["OPEN LATE", "opem late", "", "Hello"]
    assert server.requests[0]["max_tokens"] == 128


def test_retries_429_and_503_then_succeeds(server):
    statuses = {1: 429, 2: 503}
    server.handler = lambda n, body: (statuses.get(n, 200), reply("Yes", [lp("Yes", -0.1), lp("No", -2.0)])
                                      if n not in statuses else {"error": "busy"}, 0.0)
    out = judge(server, retries=3)(images(1), ["p"], [{}])
    assert out.errors == [None] and len(server.requests) == 3
    assert out.scores[0] == pytest.approx(sigmoid_of([math.exp(-0.1)], [math.exp(-2.0)]))


def test_gives_up_after_retries_on_5xx(server):
    server.handler = lambda n, body: (500, {"error": "boom"}, 0.0)
    out = judge(server, retries=2)(images(1), ["p"], [{}])
    assert len(server.requests) == 3
    assert "gave up after 3 attempts" in out.errors[0] and "HTTP 500" in out.errors[0] and "boom" in out.errors[0]


def test_400_fails_its_sample_at_once_and_not_the_others(server):
    def handle(n, body):
        if "bad" in body["messages"][0]["content"][1]["text"]:
            return 400, {"error": {"message": "image too large"}}, 0.0
        return 200, reply("Yes", [lp("Yes", -0.5), lp("No", -0.9)]), 0.0

    server.handler = handle
    out = judge(server, retries=3, question="{prompt}")(images(3), ["good", "bad", "good"], [{}] * 3)
    assert len(server.requests) == 3  # no retry for the 400
    assert out.errors[0] is None and out.errors[2] is None
    assert "HTTP 400" in out.errors[1] and "image too large" in out.errors[1] and np.isnan(out.scores[1])
    assert out.scores[0] == pytest.approx(sigmoid_of([math.exp(-0.5)], [math.exp(-0.9)]))


def test_timeout_fails_the_sample_after_retries(server):
    server.handler = lambda n, body: (200, reply("Yes", [lp("Yes", -0.1)]), 2.0)
    start = time.monotonic()
    out = judge(server, timeout_s=0.2, retries=1)(images(1), ["p"], [{}])
    assert time.monotonic() - start < 1.5
    assert len(server.requests) == 2
    assert np.isnan(out.scores[0]) and "gave up after 2 attempts" in out.errors[0] and "timed out" in out.errors[0]


def test_connection_refused_is_retried_then_recorded():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = VLMJudge(VLMJudgeArgs(base_url=f"http://127.0.0.1:{port}/v1", model="m", retries=1, backoff_s=0.01))(
        images(2), ["a", "b"], [{}, {}])
    assert all("gave up after 2 attempts" in e and "ConnectError" in e for e in out.errors)


def test_malformed_response_fails_its_sample(server):
    server.handler = lambda n, body: (200, "not json", 0.0) if n == 1 else (200, {"choices": []}, 0.0)
    out = judge(server)(images(1), ["p"], [{}])
    assert "not JSON" in out.errors[0]
    out = judge(server)(images(1), ["p"], [{}])
    assert "malformed chat-completions response" in out.errors[0]


def test_concurrency_bound_is_respected(server):
    server.handler = lambda n, body: (200, reply("Yes", [lp("Yes", -0.1), lp("No", -1.0)]), 0.15)
    out = judge(server, max_concurrency=2)(images(8), ["p"] * 8, [{}] * 8)
    assert out.failed == 0 and len(server.requests) == 8
    assert server.max_in_flight == 2


def test_callable_from_worker_threads_and_inside_a_running_loop(server):
    server.handler = lambda n, body: (200, reply("Yes", [lp("Yes", -0.1), lp("No", -1.0)]), 0.0)
    reward = judge(server)

    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda seed: reward(images(3, seed), ["p"] * 3, [{}] * 3), range(4)))
    assert all(o.failed == 0 for o in outs)

    async def inside_loop():
        return reward(images(2), ["p"] * 2, [{}] * 2)

    assert asyncio.run(inside_loop()).failed == 0


def _secret_refs(node: Any) -> Iterator[str]:
    """The environment variables a manifest fills from a Secret (``valueFrom.secretKeyRef``)."""
    if isinstance(node, dict):
        if isinstance(node.get("valueFrom"), dict) and "secretKeyRef" in node["valueFrom"]:
            yield node["name"]
        for value in node.values():
            yield from _secret_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _secret_refs(value)


MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
# What a pod or step holds besides a judge's key: every variable a manifest or launcher fills from a Secret, and
# every other secret the product reads.
CREDENTIALS = sorted({*(name for path in MANIFESTS.rglob("*.yaml") for doc in yaml.safe_load_all(path.read_text())
                        for name in _secret_refs(doc)),
                      *podspec.S3_SECRET_KEYS, *podspec.MLFLOW_SECRET_KEYS,
                      *(v.name for v in environ.VARIABLES
                        if v.kind == "secret" and v is not environ.VLM_JUDGE_API_KEY)})


@pytest.mark.parametrize("name", [*CREDENTIALS, "MY_JUDGE_KEY", "vlm_judge_api_key", "VLM_JUDGE_API_KEYS", "HOME"])
def test_a_config_names_no_other_variable_than_a_judge_key(name, server, monkeypatch):
    """A config may come from anyone who starts a run (the KFP UI on a shared cluster): its judge's key variable is
    refused when the config loads unless it is one meant for a judge's key, so a pod's credentials never reach
    base_url."""
    assert {"AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "KFP_TOKEN"} <= set(CREDENTIALS)
    monkeypatch.setenv(name, "the-credential-value")
    spec = {"name": "vlm_judge", "args": {"base_url": server.base_url, "model": "judge", "api_key_env": name}}
    with pytest.raises(ConfigError, match=r"^invalid config test: rewards\.0\.args\.api_key_env: must be "
                                          r"VLM_JUDGE_API_KEY or VLM_JUDGE_API_KEY_<NAME>") as info:
        TrainingJobConfig.from_sections({"rewards": [spec]}, "test")
    assert "the-credential-value" not in str(info.value) and "\n" not in str(info.value)
    assert server.requests == []


@pytest.mark.parametrize("name", ["VLM_JUDGE_API_KEY", "VLM_JUDGE_API_KEY_OPENAI", "VLM_JUDGE_API_KEY_2"])
def test_a_judge_key_variable_is_sent_as_the_bearer_token(name, server, monkeypatch):
    monkeypatch.setenv(name, "sk-judge")
    spec = {"name": "vlm_judge", "args": {"base_url": server.base_url, "model": "judge", "api_key_env": name}}
    config = TrainingJobConfig.from_sections({"rewards": [spec]}, "test")
    build_reward(config.rewards[0])(images(1), ["p"], [{}])
    assert server.headers[0]["Authorization"] == "Bearer sk-judge"


def test_no_api_key_sends_no_authorization(server, monkeypatch):
    monkeypatch.delenv("VLM_JUDGE_API_KEY", raising=False)
    judge(server)(images(1), ["p"], [{}])
    assert "Authorization" not in server.headers[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"base_url": "127.0.0.1:8000/v1"}, "base_url"),
        ({"base_url": "ftp://host/v1"}, "base_url"),
        ({"model": ""}, "model"),
        ({"mode": "likert"}, "mode: Input should be 'yes_no', 'score' or 'ocr'"),
        ({"question": "Rate {prompt} on {scale}"}, "only the {prompt} placeholder"),
        ({"question": "unbalanced {prompt"}, "not a valid template"),
        ({"question": "  "}, "question: must not be empty"),
        ({"mode": "score", "score_min": 5, "score_max": 5}, "score_min (5) must be below score_max (5)"),
        ({"mode": "score", "score_max": float("inf")}, "score_max: Input should be a finite number"),
        ({"max_tokens": 5}, "yes_no mode reads the first token"),
        ({"mode": "ocr", "max_tokens": 0}, "max_tokens"),
        ({"api_key_env": "sk-abc123 literal"}, "api_key_env"),
        ({"api_key": "sk-literal"}, "api_key: unknown key"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": True}, "max_concurrency"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"retries": -1}, "retries"),
        ({"retries": 1.5}, "retries"),
        ({"backoff_s": -0.1}, "backoff_s"),
        ({"mode": "ocr", "with_inputs": True}, "with_inputs judges an edit against its input; ocr mode"),
        ({"with_inputs": "yes"}, "with_inputs: Input should be a valid boolean"),
    ],
)
def test_bad_arguments_are_refused_when_the_config_loads(args, message):
    spec = {"name": "vlm_judge", "args": {"base_url": "http://127.0.0.1:8000/v1", "model": "judge", **args}}
    with pytest.raises(ConfigError, match=r"^invalid config test: rewards\.0\.args[.:]") as info:
        TrainingJobConfig.from_sections({"rewards": [spec]}, "test")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_built_from_config_by_the_registry():
    reward = build_reward(RewardSpec(name="vlm_judge", args={"base_url": "http://127.0.0.1:1/v1/", "model": "m",
                                                              "mode": "ocr"}))
    assert isinstance(reward, VLMJudge) and (reward.mode, reward.max_tokens) == ("ocr", 128)
    assert reward.base_url == "http://127.0.0.1:1/v1" and reward.question.startswith("Transcribe")


# --- the editing judge (with_inputs) ------------------------------------------------------------------------------

def decoded_parts(request: dict[str, Any]) -> tuple[list[np.ndarray], str]:
    """The images of a request's one user message, in order, and its text (the last part)."""
    content = request["messages"][0]["content"]
    assert [part["type"] for part in content] == ["image_url"] * (len(content) - 1) + ["text"]
    pictures = [np.asarray(Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))))
                for part in content[:-1]]
    return pictures, content[-1]["text"]


def edit_inputs() -> list[list[np.ndarray]]:
    rng = np.random.default_rng(7)
    # Sizes unlike the results' (16 x 16) and unlike each other, so a swapped or dropped image shows.
    return [[rng.integers(0, 256, size=(12, 20, 3), dtype=np.uint8)],
            [rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8), rng.integers(0, 256, size=(24, 10, 3),
                                                                                  dtype=np.uint8)]]


@pytest.mark.parametrize(("mode", "question"), [
    ("yes_no", 'The last image is the result of editing the image(s) before it with the instruction "{}". Was the '
               "instruction followed, with nothing else changed? Answer Yes or No."),
    ("score", 'The last image is the result of editing the image(s) before it with the instruction "{}". How well '
              "was the instruction followed, with nothing else changed? Rate it from 0 (not at all) to 10 "
              "(perfectly). Reply with the number only."),
])
def test_with_inputs_sends_the_input_images_then_the_result_and_asks_about_the_instruction(server, mode, question):
    top = [lp("Yes", -0.3), lp("No", -1.1)]
    server.handler = lambda n, body: (200, reply("Yes", top) if mode == "yes_no" else reply("8"), 0.0)
    reward = judge(server, mode=mode, with_inputs=True)
    assert reward.inputs and not VLMJudge.inputs and not judge(server, mode=mode).inputs
    batch, inputs = images(2), edit_inputs()
    prompts = ["make the sky red", "put the cat from the second image on the sofa"]
    out = reward(batch, prompts, [{}, {}], inputs=inputs)

    assert out.errors == [None, None]
    expected = sigmoid_of([math.exp(-0.3)], [math.exp(-1.1)]) if mode == "yes_no" else 0.8
    np.testing.assert_allclose(out.scores, [expected, expected], rtol=1e-12)
    sent = dict(decoded_parts(r)[::-1] for r in server.requests)  # question -> images
    for i, prompt in enumerate(prompts):
        pictures = sent[question.format(prompt)]
        assert len(pictures) == len(inputs[i]) + 1  # 2 image parts for one input, 3 for two
        for got, want in zip(pictures, [*inputs[i], batch[i]], strict=True):
            np.testing.assert_array_equal(got, want)


def test_with_inputs_a_sample_without_input_images_fails_alone_and_sends_nothing(server):
    server.handler = lambda n, body: (200, reply("Yes", [lp("Yes", -0.1), lp("No", -2.0)]), 0.0)
    reward = judge(server, with_inputs=True, question="{prompt}")
    out = reward(images(3), ["a", "b", "c"], [{}] * 3, inputs=[[images(1)[0]], [], [images(1, seed=1)[0]]])
    assert [e is None for e in out.errors] == [True, False, True] and np.isnan(out.scores[1])
    assert "with_inputs judges an edit against its input image(s), but this sample came with none" in out.errors[1]
    assert sorted(decoded_parts(r)[1] for r in server.requests) == ["a", "c"]

    # Through the scoring path, given no inputs at all (a dataset without images): each sample fails, no request.
    out = call_reward(reward, images(2), ["d", "e"], [{}, {}], [0, 1])
    assert out.failed == 2 and all("came with none" in e for e in out.errors)
    assert len(server.requests) == 2


def test_scoring_and_the_reward_server_send_inputs_to_the_editing_judge_only(server):
    """``inputs`` is per judge: the trainer's scoring and the reward server hand the inputs to the editing judge
    and leave the plain one's requests as they were (one image)."""
    from servers import running_server

    from components.reward_server.settings import ServerSettings
    from components.rewards.client import RemoteRewardSet
    from components.rewards.config import RewardServerConfig

    server.handler = lambda n, body: (200, reply("Yes", [lp("Yes", -0.2), lp("No", -0.7)]), 0.0)
    args = {"base_url": server.base_url, "model": "judge"}
    specs = [RewardSpec(name="vlm_judge", label="edit", args={**args, "with_inputs": True,
                                                              "question": "edit {prompt}"}),
             RewardSpec(name="vlm_judge", label="plain", args={**args, "question": "plain {prompt}"})]
    batch, inputs = images(2), edit_inputs()
    plain = call_reward(build_reward(specs[1]), batch, ["a", "b"], [{}, {}], [0, 1], inputs=inputs)
    assert plain.failed == 0 and [len(decoded_parts(r)[0]) for r in server.requests] == [1, 1]

    server.requests.clear()
    with running_server(ServerSettings(rewards=specs)) as url:
        client = RemoteRewardSet(specs, RewardServerConfig(url=url))
        try:
            out = client.score(batch, ["a", "b"], [{}, {}], [0, 1], ["edit", "plain"], inputs)
        finally:
            client.close()
    assert out["edit"].failed == out["plain"].failed == 0
    sent = {text: pictures for pictures, text in map(decoded_parts, server.requests)}
    assert sorted(sent) == ["edit a", "edit b", "plain a", "plain b"]
    for i, name in enumerate("ab"):
        for got, want in zip(sent[f"edit {name}"], [*inputs[i], batch[i]], strict=True):
            np.testing.assert_array_equal(got, want)
        assert len(sent[f"plain {name}"]) == 1
        np.testing.assert_array_equal(sent[f"plain {name}"][0], batch[i])
