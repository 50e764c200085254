"""The eval report page: its structure, its escaping, no network, and what a real browser shows of it."""

from __future__ import annotations

import base64
import html
import io
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from browser import screenshot  # tests/browser.py
from PIL import Image

from components.evaluate.report import PromptResult, render_report

# One saturated colour per image, far from anything the page's CSS draws, so the screenshot can find each.
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0),
           (255, 0, 255), (0, 255, 255), (255, 128, 0), (128, 0, 255)]
NASTY = "<script>alert('x')</script> & \"quotes\""


def image(colour: tuple[int, int, int], seed: int) -> np.ndarray:
    """32x32: a solid colour block over a noise stripe, so equality checks exercise lossless encoding."""
    img = np.empty((32, 32, 3), np.uint8)
    img[:] = colour
    img[26:] = np.random.default_rng(seed).integers(0, 256, (6, 32, 3), dtype=np.uint8)
    return img


def prompts() -> list[PromptResult]:
    imgs = [image(c, i) for i, c in enumerate(COLOURS)]
    return [
        PromptResult(prompt=f"a sign that says {NASTY}", seed=7, base_images=imgs[0:2], lora_images=imgs[2:4],
                     base_scores={"ocr": [0.25, 0.75], "aesthetic": [5.0, 5.5]},
                     lora_scores={"ocr": [0.5, 1.0], "aesthetic": [4.0, 4.5]}),
        PromptResult(prompt="a red cat", seed=8, base_images=imgs[4:6], lora_images=imgs[6:8],
                     base_scores={"ocr": [0.1, 0.2], "aesthetic": [5.0, 6.0]},
                     lora_scores={"ocr": [0.3, math.nan], "aesthetic": [5.0, 6.0]}),
    ]


SUMMARY = {
    "rewards": {
        "ocr": {"base_mean": 0.41, "lora_mean": 0.57, "delta": 0.16, "ci_low": 0.08, "ci_high": 0.23,
                "ci_level": 0.95, "n": 32},
        "aesthetic": {"base_mean": 5.4, "lora_mean": 5.37, "delta": -0.03, "ci_low": -0.1, "ci_high": 0.04,
                      "ci_level": 0.95, "n": 32},
    },
    "gate": {"promoted": True, "alias": "candidate", "reason": f"ocr improved by 0.16 >= 0.05 {NASTY}",
             "model": "flowgrpo-ocr", "version": "3"},
    "warnings": [f"reward hacking? training reward 'ocr' rose by 0.2 while eval 'ocr' fell {NASTY}"],
    "config": {"model": "tiny", "eval steps": 10, "seeds": [7, 8]},
}
# Epoch 4 failed (all rewards NaN -> null in metrics.jsonl): no point for it.
HISTORY = [{"epoch": e, "reward/mean": None if e == 4 else 0.1 + 0.05 * e, "reward/std": None if e == 4 else 0.02,
            "reward/ocr/mean": None if e == 4 else 0.2 + 0.03 * e, "reward/aesthetic/mean": 5.0 - 0.01 * e}
           for e in range(10)]


class Page(HTMLParser):
    """Collects the elements (tag + attributes) and the text of a page."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.text.append(data)

    @property
    def tags(self) -> list[str]:
        return [tag for tag, _ in self.elements]

    def values(self, tag: str, name: str) -> list[str]:
        return [a[name] for t, a in self.elements if t == tag and name in a]

    def polyline(self, series: str) -> list[tuple[float, ...]]:
        [points] = [a["points"] for t, a in self.elements if t == "polyline" and a.get("data-series") == series]
        return [tuple(map(float, p.split(","))) for p in points.split()]


@pytest.fixture(scope="module")
def page() -> str:
    return render_report(SUMMARY, prompts(), HISTORY, title=f"eval {NASTY}")


def decode_png(uri: str) -> np.ndarray:
    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix)
    raw = base64.b64decode(uri[len(prefix):], validate=True)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def test_images_are_inlined_losslessly_in_order(page):
    srcs = Page(page).values("img", "src")
    # Both prompts gained ocr (+0.25, then +0.15): the biggest wins show them first, then the full list again.
    sources = [img for p in prompts() * 2 for img in (*p.base_images, *p.lora_images)]
    assert len(srcs) == len(sources) == 16
    for src, expected in zip(srcs, sources, strict=True):
        assert np.array_equal(decode_png(src), expected)


def test_user_strings_are_escaped(page):
    parsed = Page(page)
    assert "script" not in parsed.tags  # the page has no script of its own, so any would be injected
    assert "<script>" not in page.lower()
    # <title>, <h1>, gate reason, warning, prompt heading (among the biggest wins and in the full list).
    assert page.count("&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quotes&quot;") == 6
    assert f"a sign that says {NASTY}" in "".join(parsed.text)  # shown to the reader as typed


def test_no_network_resources(page):
    for tag, attrs in Page(page).elements:
        for name, value in attrs.items():
            if name in {"src", "href", "srcset", "xlink:href", "action", "poster", "data"}:
                assert value.startswith("data:"), (tag, name, value[:80])
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"url\(|@import|<link|<iframe|<object|<embed", page, re.I)


def test_history_curve_points(page):
    parsed = Page(page)
    mean = parsed.polyline("reward/mean")
    assert len(mean) == sum(r["reward/mean"] is not None for r in HISTORY) == 9
    assert [x for x, _ in mean] == sorted(x for x, _ in mean)  # epochs left to right
    assert mean[-1][1] < mean[0][1]  # reward rose, and SVG y grows downwards
    assert len(parsed.polyline("reward/ocr/mean")) == 9
    assert len(parsed.polyline("reward/aesthetic/mean")) == 10
    assert "std-band" in parsed.values("polygon", "class")
    text = "".join(parsed.text)
    assert "epoch 0" in text and "9" in text


def test_verdict_table_and_captions(page):
    text = "".join(Page(page).text)
    assert "PROMOTED" in text and "NOT PROMOTED" not in text and "candidate" in text
    assert "ocr improved by 0.16" in text and "reward hacking?" in text
    assert '<span class="pos">+0.160</span>' in page and '<span class="neg">-0.030</span>' in page
    assert "[0.080, 0.230]" in text and "95%" in text
    # Prompt 1: ocr 0.5 -> 0.75 (+0.25), aesthetic 5.25 -> 4.25 (-1.0); prompt 2 NaN lora ocr -> "failed".
    assert '<span class="pos">+0.250</span>' in page and '<span class="neg">-1.000</span>' in page
    assert "ocr failed" in text
    assert '<span class="pos">+0.150</span>' in page  # prompt 2's ocr delta uses the finite score only


def test_not_promoted_empty_history_and_failed_scores():
    summary = {**SUMMARY, "gate": {"promoted": False, "reason": "ocr improved by only 0.01 < 0.05"}, "warnings": []}
    result = PromptResult(prompt="p", seed=1, base_images=[image(COLOURS[0], 0)], lora_images=[image(COLOURS[1], 1)],
                          base_scores={"ocr": [math.nan]}, lora_scores={"ocr": [math.nan]})
    page = render_report(summary, [result], [], title="t")
    text = " ".join(Page(page).text)
    assert "no training history" in text and "NOT PROMOTED" in text and "Warnings" not in text
    assert text.count("failed") >= 3  # both captions and the per-prompt delta
    assert "<polyline" not in page
    # A history whose every epoch failed has nothing to draw either.
    assert "no training history" in render_report(summary, [result], [{"epoch": 0, "reward/mean": None}], title="t")
    assert "No promotion gate" in render_report({**summary, "gate": None}, [], [], title="t")


def test_a_ci_over_too_few_prompts_is_marked_next_to_it():
    rewards = {"ocr": {**SUMMARY["rewards"]["ocr"], "n": 2, "few_prompts": True},
               "aesthetic": {**SUMMARY["rewards"]["aesthetic"], "few_prompts": False}}
    page = render_report({**SUMMARY, "rewards": rewards}, [], [], title="t")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"<tr><td>(\w+)</td>.*?</tr>", page)}
    assert re.search(r"\[0\.080, 0\.230\] <span class=\"muted\">95%</span> <span class=\"few-prompts\"[^>]*>only 2 "
                     r"prompt\(s\): too few for this CI to mean much</span></td><td>2</td>", rows["ocr"]), rows["ocr"]
    assert "few-prompts" not in rows["aesthetic"]
    assert "few-prompts\"" not in render_report(SUMMARY, [], [], title="t")  # eval.json without the flag: none


def test_mismatched_scores_are_rejected():
    bad = PromptResult(prompt="p", seed=1, base_images=[image(COLOURS[0], 0)], lora_images=[],
                       base_scores={"ocr": [0.1, 0.2]}, lora_scores={})
    with pytest.raises(ValueError, match="2 values for 1 images"):
        render_report(SUMMARY, [bad], [], title="t")


def test_browser_shows_the_images(page, tmp_path: Path):
    html_path, png_path = tmp_path / "report.html", tmp_path / "shot.png"
    html_path.write_text(page, encoding="utf-8")
    width, height = 1400, 2600
    screenshot(html_path, png_path, width, height)
    shot = np.asarray(Image.open(png_path).convert("RGB")).astype(np.int16)
    assert shot.shape == (height, width, 3)
    assert (np.abs(shot - 255).sum(axis=2) > 60).mean() > 0.02  # not a blank white page
    for colour in COLOURS:
        near = (np.abs(shot - np.array(colour)).max(axis=2) <= 24).sum()
        # Each 32x32 image has 26 solid rows; shown at >= 128 px wide that is >= 128 * 104 pixels. More
        # than half of that proves the image both rendered and was upscaled (natively it has 832).
        assert near > 128 * 104 // 2, (colour, int(near))


def _sections(page: str) -> dict[str, str]:
    """The page's HTML after each <h2> up to the next one, by heading text."""
    parts = re.split(r"<h2>(.*?)</h2>", page)
    return {html.unescape(heading): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def _prompt_names(section: str) -> list[str]:
    return [html.unescape(name) for name in re.findall(r'<div class="prompt"><h3>(.*?)</h3>', section)]


# geneval (the gated reward, second in eval.json) deltas per prompt; geneval_strict's are their negatives, so
# picking the wrong reward would swap wins and losses. None: the base failed geneval on that prompt.
GENEVAL_DELTAS = {"p0": 0.5, "p1": -0.25, "p2": 0.0, "p3": 0.75, "p4": 0.125, "p5": -0.5, "p6": 0.25, "p7": 0.0,
                  "p8": None}
DEMO_SUMMARY = {
    "rewards": {
        "geneval_strict": {"delta": -0.031, "ci_low": -0.094, "ci_high": 0.031, "ci_level": 0.95, "n": 8},
        "geneval": {"delta": 0.109, "ci_low": -0.078, "ci_high": 0.297, "ci_level": 0.95, "n": 8,
                    "few_prompts": True},
    },
    "gate": {"promoted": False, "reason": "too few prompts", "metric": "geneval"},
}


def demo_prompts() -> list[PromptResult]:
    return [PromptResult(prompt=name, seed=i, base_images=[image(COLOURS[i % 8], i)],
                         lora_images=[image(COLOURS[(i + 1) % 8], i)],
                         base_scores={"geneval": [math.nan if d is None else 0.25], "geneval_strict": [0.5]},
                         lora_scores={"geneval": [0.25 + (d or 0.0)], "geneval_strict": [0.5 - (d or 0.0)]})
            for i, (name, d) in enumerate(GENEVAL_DELTAS.items())]


def test_summary_counts_prompts_by_the_gated_rewards_delta_and_lists_every_reward_with_its_ci():
    page = render_report(DEMO_SUMMARY, demo_prompts(), [], title="t")
    heads = list(_sections(page))
    assert heads[:4] == ["Summary", "Biggest wins on geneval", "Biggest losses on geneval", "Eval rewards"]
    assert page.index('class="gate rejected"') < page.index("<h2>Summary</h2>")
    summary = _sections(page)["Summary"]
    assert ("<b>geneval</b> (the gated reward), LoRA − base: <span class=\"pos\">4 prompts better</span> / "
            "<span class=\"neg\">2 worse</span> / 2 tied / 1 without a score") in summary
    assert ('<li><b>geneval_strict</b>: <span class="neg">-0.031</span> CI [-0.094, 0.031] '
            '<span class="muted">95%</span>') in summary
    assert ('<li><b>geneval</b> (the gated reward): <span class="pos">+0.109</span> CI [-0.078, 0.297] '
            '<span class="muted">95%</span>') in summary
    assert "only 8 prompt(s): too few" in summary  # the few-prompts mark travels with the CI


def test_biggest_wins_and_losses_are_the_top_three_by_the_gated_rewards_delta():
    sections = _sections(render_report(DEMO_SUMMARY, demo_prompts(), [], title="t"))
    assert _prompt_names(sections["Biggest wins on geneval"]) == ["p3", "p0", "p6"]  # +0.75, +0.5, +0.25
    assert _prompt_names(sections["Biggest losses on geneval"]) == ["p5", "p1"]  # -0.5, -0.25; zeros are neither
    win = sections["Biggest wins on geneval"]
    assert len(Page(win).values("img", "src")) == 3 * 2  # base and LoRA side by side
    assert '<span class="pos">+0.750</span>' in win.split('<div class="prompt">')[1]
    assert _prompt_names(sections["Base vs LoRA per prompt"]) == list(GENEVAL_DELTAS)  # all, in eval order


def test_without_wins_or_losses_the_report_says_so_and_without_a_gate_the_first_reward_is_summarised():
    flat = [p for p in demo_prompts() if GENEVAL_DELTAS[p.prompt] == 0.0]
    sections = _sections(render_report(DEMO_SUMMARY, flat, [], title="t"))
    assert "no prompt improved" in sections["Biggest wins on geneval"]
    assert "no prompt got worse" in sections["Biggest losses on geneval"]
    assert "0 prompts better</span> / <span class=\"neg\">0 worse</span> / 2 tied</p>" in sections["Summary"]
    # No gate: the first eval reward (geneval_strict, deltas negated) decides wins and losses, unlabelled.
    sections = _sections(render_report({**DEMO_SUMMARY, "gate": None}, demo_prompts(), [], title="t"))
    assert _prompt_names(sections["Biggest wins on geneval_strict"]) == ["p5", "p1"]
    assert "gated" not in sections["Summary"]


def test_heldout_curves_start_at_the_base_value_and_follow_the_epochs_they_were_sampled_at():
    history = [{"epoch": e, "reward/mean": 0.1 * e} for e in range(1, 11)]
    history[0] |= {"heldout/geneval/base": 0.25, "heldout/geneval_strict/base": 0.0}
    history[4] |= {"heldout/geneval/mean": 0.3, "heldout/geneval_strict/mean": None}  # a failed sample: no point
    history[9] |= {"heldout/geneval/mean": 0.4, "heldout/geneval_strict/mean": 0.125}
    page = render_report(DEMO_SUMMARY, [], history, title="t")
    parsed = Page(_sections(page)["Summary"])
    (x0, y0), (x5, y5), (x10, y10) = parsed.polyline("held-out geneval (fixed prompts and noise)")
    assert (x5 - x0) / (x10 - x0) == pytest.approx(0.5, abs=0.01)  # epoch 5 halfway from 0 to 10
    assert (y0 - y5) / (y0 - y10) == pytest.approx((0.3 - 0.25) / (0.4 - 0.25), abs=0.01)  # SVG y grows down
    strict = parsed.polyline("held-out geneval_strict (fixed prompts and noise)")
    assert len(strict) == 2 and strict[0][0] == x0 and strict[1][0] == x10
    assert "epoch 0" in "".join(parsed.text)
    assert "held-out" not in page.replace("held-out geneval", "")  # no chart for anything else
    assert "held-out" not in render_report(DEMO_SUMMARY, [], HISTORY, title="t")  # none recorded: none drawn


def test_a_video_is_inlined_as_a_lossless_animated_webp_beside_its_first_middle_and_last_frames():
    rng = np.random.default_rng(0)
    videos = [rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8) for _ in range(2)]
    result = PromptResult(prompt="a cat walking", seed=1, base_images=videos[:1], lora_images=videos[1:],
                          base_scores={"ocr": [0.1]}, lora_scores={"ocr": [0.2]})
    srcs = Page(render_report(SUMMARY, [result], [], title="t")).values("img", "src")
    webps = [s for s in srcs if s.startswith("data:image/webp;base64,")]
    strips = [decode_png(s) for s in srcs if s.startswith("data:image/png")]
    assert len(webps) == len(strips) == 4  # base and LoRA, in the wins list and in the full list
    for webp, strip, video in zip(webps, strips, videos * 2, strict=True):
        with Image.open(io.BytesIO(base64.b64decode(webp.partition(",")[2]))) as im:
            assert im.n_frames == 5
            frames = []
            for i in range(im.n_frames):
                im.seek(i)
                frames.append(np.asarray(im.convert("RGB"))[::4, ::4])  # scaled up 4x, nearest
        assert np.array_equal(np.stack(frames), video)
        assert np.array_equal(strip, np.concatenate([video[0], video[2], video[4]], axis=1))
