"""The `ocr` reward on rendered text, checked against rapidocr called directly and the text_match formula."""

import threading

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont
from rapidocr import RapidOCR

from components.errors import ConfigError
from components.rewards import ocr
from components.rewards.arguments import OcrArgs
from components.rewards.ocr import OcrReward
from components.rewards.registry import RewardSpec, build_reward
from components.rewards.text_match import ocr_score
from components.trainer.config import TrainingJobConfig

BLANK = np.full((128, 512, 3), 255, dtype=np.uint8)


def render(text: str, width: int = 512, height: int = 128, size: int = 48) -> np.ndarray:
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((width // 2, height // 2), text, fill="black",
                               font=ImageFont.load_default(size=size), anchor="mm", align="center")
    return np.asarray(image)


@pytest.fixture(scope="module")
def reward() -> OcrReward:
    return OcrReward()


@pytest.fixture(scope="module")
def hello() -> np.ndarray:
    return render("Hello World")


def test_text_matching_the_quoted_prompt_scores_one(reward, hello):
    assert reward.score(hello, 'a sign that says "Hello World"', {}) == 1.0


def test_wrong_target_scores_the_formula_on_what_rapidocr_reads(reward, hello):
    # Read the image with rapidocr directly, at the reward's detection size (its default, short side
    # to 736 px, costs 5 s here); the bundled models are named so nothing is fetched.
    models = ocr.bundled_model_dir()
    engine = RapidOCR(params={"Det.model_path": str(models / ocr.BUNDLED_MODELS["Det"]),
                              "Rec.model_path": str(models / ocr.BUNDLED_MODELS["Rec"]),
                              "Det.limit_type": "max", "Det.limit_side_len": 960,
                              "Global.use_cls": False, "Global.log_level": "error"})
    recognized = " ".join(engine(np.ascontiguousarray(hello[..., ::-1])).txts)
    assert recognized.replace(" ", "").lower() == "helloworld"
    expected = ocr_score(recognized, "Goodbye")
    assert reward.score(hello, 'a sign that says "Goodbye"', {}) == expected
    assert expected < 0.5


def test_blank_image(reward):
    assert reward.recognize(BLANK) == ""
    assert reward.score(BLANK, "a plain white wall", {}) == 1.0  # empty target, nothing read
    assert reward.score(BLANK, 'a sign that says "Hello"', {}) == 0.0


def test_ground_truth_overrides_the_quotes(reward, hello):
    assert reward.score(hello, 'a sign that says "Goodbye"', {"ground_truth": "Hello World"}) == 1.0
    assert reward.score(hello, 'a sign that says "Hello World"', {"ground_truth": "Goodbye"}) < 0.5


def test_lines_are_read_top_to_bottom(reward):
    assert reward.recognize(render("Top\nBottom", height=256)) == "Top Bottom"


def test_small_and_degenerate_images_never_raise(reward):
    rng = np.random.default_rng(0)
    # A 32 px image is enlarged before OCR, so its text is still read.
    assert reward.score(render("Hi", 32, 32, 16), '"Hi"', {}) == 1.0
    images = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), rng.integers(0, 256, (1, 512, 3), dtype=np.uint8)]
    for image in images:
        out = reward(image[None], ['"Hi"'], [{}])
        assert out.errors == [None] and np.isfinite(out.scores[0])
    out = reward(np.zeros((1, 4, 4), dtype=np.uint8), ['"Hi"'], [{}])  # not RGB: a recorded failure
    assert np.isnan(out.scores[0]) and "RGB" in out.errors[0]


def test_concurrent_calls_share_one_engine(monkeypatch, hello):
    reward, created = OcrReward(), []
    real = ocr.RapidOCR

    def counting(**kwargs):
        created.append(1)
        return real(**kwargs)

    monkeypatch.setattr(ocr, "RapidOCR", counting)
    scores: list[float] = []
    threads = [threading.Thread(target=lambda: scores.append(reward.score(hello, '"Hello World"', {})))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scores == [1.0] * 3 and len(created) == 1


def test_nothing_is_downloaded(monkeypatch, hello):
    def refuse(*args, **kwargs):
        raise AssertionError("rapidocr tried to download a file")

    monkeypatch.setattr("rapidocr.utils.download_file.DownloadFile.run", refuse)
    monkeypatch.setattr("requests.get", refuse)
    assert OcrReward(OcrArgs(use_angle_cls=True)).score(hello, '"Hello World"', {}) == 1.0


@pytest.mark.parametrize(("args", "message"), [
    ({"min_confidence": 1.5}, "min_confidence: Input should be less than or equal to 1 (got 1.5)"),
    ({"min_confidence": "high"}, "min_confidence: Input should be a valid number (got 'high')"),
    ({"use_angle_cls": "yes"}, "use_angle_cls: Input should be a valid boolean (got 'yes')"),
])
def test_bad_arguments_are_refused_when_the_config_loads(args, message):
    with pytest.raises(ConfigError) as info:
        TrainingJobConfig.from_sections({"rewards": [{"name": "ocr", "args": args}]}, "test")
    assert f"rewards.0.args.{message}" in str(info.value)


def test_built_by_name():
    reward = build_reward(RewardSpec(name="ocr", args={"min_confidence": 0.3, "use_angle_cls": True}))
    assert isinstance(reward, OcrReward)
    assert (reward._params["Global.text_score"], reward._params["Global.use_cls"]) == (0.3, True)
