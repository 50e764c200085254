"""The evaluation report: one self-contained HTML page (no scripts, no network, images inlined as PNG, videos as
animated WebP)."""

from __future__ import annotations

import base64
import html
import io
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from components.trainer.samples import animated, key_frames


@dataclass
class PromptResult:
    """One eval prompt: the images of base and LoRA for one seed and their scores per reward."""

    prompt: str
    seed: int
    base_images: list[np.ndarray]  # each (H, W, 3) uint8, or a video (F, H, W, 3)
    lora_images: list[np.ndarray]
    base_scores: dict[str, list[float]]  # reward key -> one score per image (NaN = the reward failed)
    lora_scores: dict[str, list[float]]
    input_images: list[np.ndarray] = field(default_factory=list)  # an edit's input images, as the model saw them


# Distinguishable on white; the first is the overall reward/mean line.
_PALETTE = ["#1f5fbf", "#d9480f", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285", "#e67700", "#5c940d"]
_KEY_MEAN = re.compile(r"^reward/(.+)/mean$")
_HELDOUT = re.compile(r"^heldout/(.+)/(?:mean|base)$")

_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { margin-bottom: 4px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f1f3f5; }
.info td { text-align: left; }
.gate { padding: 12px 16px; border-radius: 6px; font-size: 1.2em; margin: 12px 0; border: 2px solid; }
.gate.promoted { background: #ebfbee; border-color: #2b8a3e; }
.gate.rejected { background: #fff4e6; border-color: #d9480f; }
.gate.none { background: #f1f3f5; border-color: #adb5bd; }
.warnings { background: #fff3bf; border-left: 6px solid #f08c00; padding: 8px 16px; margin: 12px 0; }
.pos { color: #2b8a3e; font-weight: bold; }
.neg { color: #c92a2a; font-weight: bold; }
.zero { color: #868e96; }
.failed { color: #c92a2a; font-style: italic; }
.prompt { border-top: 1px solid #dee2e6; padding: 12px 0; }
.prompt h3 { margin: 0 0 4px; font-weight: normal; white-space: pre-wrap; }
.sides { display: flex; gap: 32px; flex-wrap: wrap; }
.images { display: flex; gap: 8px; flex-wrap: wrap; }
figure { margin: 0; }
figcaption { font-size: 0.8em; font-family: monospace; }
/* Eval images may be tiny (32 px on the tiny model): upscale without blurring so pixels stay visible. */
img.sample { image-rendering: pixelated; min-width: 128px; max-width: 256px; height: auto; display: block; }
img.strip { max-width: 768px; }
.muted { color: #868e96; }
.few-prompts { color: #e67700; font-weight: bold; }
"""


def render_report(summary: dict, prompts: list[PromptResult], history: list[dict], *, title: str) -> str:
    """The whole report page as one HTML string: the verdict and a summary first (counts, deltas with CIs,
    held-out curves, biggest wins and losses), then the tables, training curves and every prompt."""
    rewards = summary.get("rewards") or {}
    order = list(rewards)
    gate = summary.get("gate") or {}
    # The gate's reward (eval.json names it), else the first: the one whose gain the verdict is about.
    metric = gate["metric"] if gate.get("metric") in rewards else next(iter(rewards), None)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>",
        # No resource may leave the file: forbid everything but inline styles and data: images.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "img-src data:; style-src 'unsafe-inline'\">",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        _run_info(summary),
        _gate(gate),
        _warnings(summary.get("warnings") or []),
        _summary(rewards, metric, bool(gate), prompts, history),
        *_wins_and_losses(prompts, metric, order),
        "<h2>Eval rewards</h2>",
        _reward_table(rewards),
        "<h2>Training reward</h2>",
        _history_svg(history),
        "<h2>Base vs LoRA per prompt</h2>",
    ]
    if not prompts:
        parts.append('<p class="muted">no prompts evaluated</p>')
    parts.extend(_prompt_section(p, order) for p in prompts)
    parts.append("</body></html>")
    return "\n".join(parts)


def _e(value: object) -> str:
    """HTML-escape any user-provided value (quotes too: some land in attributes)."""
    return html.escape(str(value), quote=True)


def _finite(value: object) -> float | None:
    """The value as a float, or None when missing, non-numeric or non-finite (a failed reward/epoch)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _num(value: object, digits: int = 3) -> str:
    v = _finite(value)
    return '<span class="failed">failed</span>' if v is None else f"{v:.{digits}f}"


def _delta(value: object) -> str:
    """A signed, coloured delta: green up, red down."""
    v = _finite(value)
    if v is None:
        return '<span class="failed">failed</span>'
    cls = "pos" if v > 0 else "neg" if v < 0 else "zero"
    return f'<span class="{cls}">{v:+.3f}</span>'


def _run_info(summary: dict) -> str:
    config = summary.get("config") or {}
    gate = summary.get("gate") or {}
    rows = [(k, v) for k, v in config.items()]
    if gate.get("model"):
        rows.append(("registered model", f"{gate['model']} v{gate.get('version', '?')}"))
    if not rows:
        return ""
    cells = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="info">{cells}</table>'


def _gate(gate: dict | None) -> str:
    if not gate:
        return '<div class="gate none"><b>No promotion gate</b> was applied to this evaluation.</div>'
    promoted = bool(gate.get("promoted"))
    verdict = "PROMOTED" if promoted else "NOT PROMOTED"
    if promoted and gate.get("alias"):
        verdict += f" to alias <code>{_e(gate['alias'])}</code>"
    reason = f"<br>{_e(gate['reason'])}" if gate.get("reason") else ""
    return f'<div class="gate {"promoted" if promoted else "rejected"}"><b>{verdict}</b>{reason}</div>'


def _warnings(warnings: Sequence[str]) -> str:
    if not warnings:
        return ""
    items = "".join(f"<li>{_e(w)}</li>" for w in warnings)
    return f'<div class="warnings"><b>Warnings</b><ul>{items}</ul></div>'


def _reward_table(rewards: dict) -> str:
    if not rewards:
        return '<p class="muted">no eval rewards</p>'
    head = "<tr><th>reward</th><th>base mean</th><th>LoRA mean</th><th>delta</th><th>CI</th><th>n</th></tr>"
    rows = [f"<tr><td>{_e(key)}</td><td>{_num(r.get('base_mean'))}</td><td>{_num(r.get('lora_mean'))}</td>"
            f"<td>{_delta(r.get('delta'))}</td><td>{_ci(r)}</td><td>{_e(r.get('n', ''))}</td></tr>"
            for key, r in rewards.items()]
    return f"<table>{head}{''.join(rows)}</table>"


def _ci(row: dict) -> str:
    """A summary row's interval, its level, and a mark when it rests on too few prompts."""
    level = _finite(row.get("ci_level"))
    ci = f"[{_num(row.get('ci_low'))}, {_num(row.get('ci_high'))}]"
    if level is not None:
        ci += f' <span class="muted">{level * 100:g}%</span>'
    if row.get("few_prompts") and row.get("n"):
        # eval.json's flag (evaluate.MIN_PROMPTS_FOR_CI): the interval is shown but must not be trusted.
        ci += (f' <span class="few-prompts" title="a bootstrap interval over so few prompts says little">'
               f"only {_e(row['n'])} prompt(s): too few for this CI to mean much</span>")
    return ci


def _summary(rewards: dict, metric: str | None, gated: bool, prompts: list[PromptResult],
             history: list[dict]) -> str:
    """How many prompts ``metric`` says got better, worse or stayed, each eval reward's delta and CI, and the
    held-out curves the trainer recorded."""
    if metric is None:
        return ""
    deltas = [_prompt_delta(p, metric) for p in prompts]
    better, worse = sum(d is not None and d > 0 for d in deltas), sum(d is not None and d < 0 for d in deltas)
    unscored = f" / {deltas.count(None)} without a score" if None in deltas else ""
    role = " (the gated reward)" if gated else ""
    counts = (f'<p class="counts">Per prompt on <b>{_e(metric)}</b>{role}, LoRA − base: '
              f'<span class="pos">{better} prompts better</span> / <span class="neg">{worse} worse</span> / '
              f"{deltas.count(0.0)} tied{unscored}</p>")
    lines = "".join(f"<li><b>{_e(key)}</b>{role if key == metric else ''}: {_delta(r.get('delta'))} CI {_ci(r)}</li>"
                    for key, r in rewards.items())
    return f'<h2>Summary</h2>{counts}<ul class="deltas">{lines}</ul>{_heldout_svg(history)}'


def _wins_and_losses(prompts: list[PromptResult], metric: str | None, order: list[str]) -> list[str]:
    """The 3 prompts ``metric`` improved most and the 3 it worsened most; a zero delta is neither."""
    if metric is None:
        return []
    scored = [(d, p) for p in prompts if (d := _prompt_delta(p, metric)) is not None]
    wins = sorted((x for x in scored if x[0] > 0), key=lambda x: -x[0])[:3]
    losses = sorted((x for x in scored if x[0] < 0), key=lambda x: x[0])[:3]
    parts = []
    for heading, picked, none in (("Biggest wins", wins, "improved"), ("Biggest losses", losses, "got worse")):
        parts.append(f"<h2>{heading} on {_e(metric)}</h2>")
        parts.extend(_prompt_section(p, order) for _, p in picked)
        if not picked:
            parts.append(f'<p class="muted">no prompt {none}</p>')
    return parts


def _history_svg(history: list[dict]) -> str:
    """reward/mean per epoch with a ±std band; with several rewards also one small chart per reward key
    (their scales differ, e.g. OCR in [0, 1] vs aesthetic ~5, so one shared y axis would flatten them)."""
    rows = [(x, row) for i, row in enumerate(history) if (x := _finite(row.get("epoch", i))) is not None]

    def series(key: str) -> list[tuple[float, float]]:
        return [(x, v) for x, row in rows if (v := _finite(row.get(key))) is not None]

    mean = series("reward/mean")
    band = [(x, m, s) for x, row in rows
            if (m := _finite(row.get("reward/mean"))) is not None and (s := _finite(row.get("reward/std"))) is not None]
    keys = sorted({m.group(1) for _, row in rows for k in row if (m := _KEY_MEAN.match(k))})
    charts = [("reward/mean", mean, band, 560, 240)]
    if len(keys) > 1:
        charts += [(f"reward/{k}/mean", series(f"reward/{k}/mean"), [], 360, 180) for k in keys]
    if not any(points for _, points, *_ in charts):
        return '<p class="muted">no training history</p>'
    # One x range for all charts (every epoch, failed ones too) so they line up and gaps show.
    xr = (min(x for x, _ in rows), max(x for x, _ in rows))
    svgs = [_chart(name, pts, bnd, xr, _PALETTE[i % len(_PALETTE)], w, h)
            for i, (name, pts, bnd, w, h) in enumerate(charts)]
    return f'<div class="sides">{"".join(svgs)}</div>'


def _heldout_svg(history: list[dict]) -> str:
    """One chart per reward the trainer scored on its fixed held-out prompts and noise: its base value (first
    row, before any training) at epoch 0, then the value after each epoch it sampled them."""
    keys = sorted({m.group(1) for row in history for k in row if (m := _HELDOUT.match(k))})
    charts = []
    for key in keys:
        base = _finite(history[0].get(f"heldout/{key}/base"))
        points = [(0.0, base)] if base is not None else []
        points += [(x, v) for row in history if (x := _finite(row.get("epoch"))) is not None
                   and (v := _finite(row.get(f"heldout/{key}/mean"))) is not None]
        if points:
            xs = [x for x, _ in points]
            # wider than the per-reward training charts: the longer name must fit above the plot
            charts.append(_chart(f"held-out {key} (fixed prompts and noise)", points, [], (min(xs), max(xs)),
                                 _PALETTE[len(charts) % len(_PALETTE)], 440, 180))
    return f'<div class="sides">{"".join(charts)}</div>' if charts else ""


def _chart(name: str, points: list[tuple[float, float]], band: list[tuple[float, float, float]],
           xr: tuple[float, float], colour: str, width: int, height: int) -> str:
    """One inline-SVG line chart with its name on top and min/max labels on both axes."""
    if not points:
        return f'<p class="muted">{_e(name)}: no values</p>'
    ys = [y for _, y in points] + [m + d for _, m, s in band for d in (s, -s)]
    (x0, x1), y0, y1 = xr, min(ys), max(ys)
    if y1 - y0 < 1e-12:  # a flat curve still needs a visible y range
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, right, top, bottom = 56, 12, 22, 30  # room for the y labels, the name and the x labels
    pw, ph = width - left - right, height - top - bottom

    def px(x: float, y: float) -> str:
        sx = left + (pw / 2 if x1 == x0 else (x - x0) / (x1 - x0) * pw)
        return f"{sx:.1f},{top + (y1 - y) / (y1 - y0) * ph:.1f}"

    # Inline SVG in HTML needs no xmlns; leaving it out keeps the page free of any http:// string.
    note = ' <tspan font-weight="normal" fill="#868e96">(band: ±std)</tspan>' if band else ""
    out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" '
           f'font-size="11"><text x="{left}" y="14" font-weight="bold">{_e(name)}{note}</text>']
    if band:
        outline = [px(x, m + s) for x, m, s in band] + [px(x, m - s) for x, m, s in reversed(band)]
        out.append(f'<polygon class="std-band" points="{" ".join(outline)}" fill="{colour}" '
                   'fill-opacity="0.18" stroke="none"/>')
    bx, by = left, top + ph
    out.append(f'<line x1="{bx}" y1="{top}" x2="{bx}" y2="{by}" stroke="#444"/>'
               f'<line x1="{bx}" y1="{by}" x2="{left + pw}" y2="{by}" stroke="#444"/>'
               f'<text x="{bx - 4}" y="{top + 4}" text-anchor="end">{y1:.3g}</text>'
               f'<text x="{bx - 4}" y="{by}" text-anchor="end">{y0:.3g}</text>'
               f'<text x="{bx}" y="{by + 14}">epoch {x0:g}</text>'
               f'<text x="{left + pw}" y="{by + 14}" text-anchor="end">{x1:g}</text>')
    out.append(f'<polyline class="{"mean" if band else "series"}" data-series="{_e(name)}" '
               f'points="{" ".join(px(x, y) for x, y in points)}" fill="none" stroke="{colour}" stroke-width="2"/>')
    return "".join(out) + "</svg>"


def _png_data_uri(image: np.ndarray) -> str:
    """Lossless inline PNG, so the page shows exactly the pixels the rewards scored."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"report images must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image)).save(buf, format="PNG", compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _sample_img(alt: str, image: np.ndarray) -> str:
    """An image; a video (F, H, W, 3) as a looping animated WebP beside a still of its first, middle and last
    frames (inline, as the page's images are: the report is one self-contained file)."""
    if np.ndim(image) != 4:
        return f'<img class="sample" alt="{_e(alt)}" src="{_png_data_uri(image)}">'
    webp = base64.b64encode(animated(image)).decode("ascii")
    return (f'<img class="sample" alt="{_e(alt)} (video)" src="data:image/webp;base64,{webp}">'
            f'<img class="sample strip" alt="{_e(alt)}: first, middle and last frames" '
            f'src="{_png_data_uri(key_frames(image[None])[0])}">')


def _side(label: str, images: list[np.ndarray], scores: dict[str, list[float]], keys: list[str]) -> str:
    figures = []
    for i, image in enumerate(images):
        caption = "<br>".join(f"{_e(k)} {_num(scores[k][i]) if k in scores else 'n/a'}" for k in keys)
        figures.append(f"<figure>{_sample_img(f'{label} {i}', image)}<figcaption>{caption}</figcaption></figure>")
    return f'<div><b>{_e(label)}</b><div class="images">{"".join(figures)}</div></div>'


def _mean(values: Iterable[float]) -> float | None:
    ok = [v for x in values if (v := _finite(x)) is not None]
    return sum(ok) / len(ok) if ok else None


def _prompt_delta(result: PromptResult, key: str) -> float | None:
    """LoRA - base of the prompt's mean score (over the images the reward scored); None when one side has none."""
    base, lora = _mean(result.base_scores.get(key, [])), _mean(result.lora_scores.get(key, []))
    return None if base is None or lora is None else lora - base


def _prompt_section(result: PromptResult, order: list[str]) -> str:
    for side, images, scores in (("base", result.base_images, result.base_scores),
                                 ("LoRA", result.lora_images, result.lora_scores)):
        for key, values in scores.items():
            if len(values) != len(images):  # a caption would silently belong to the wrong image
                raise ValueError(f"{side} scores for {key!r} have {len(values)} values for {len(images)} images")
    present = set(result.base_scores) | set(result.lora_scores)
    keys = [k for k in order if k in present] + sorted(present - set(order))
    deltas = [f"{_e(k)} {_delta(_prompt_delta(result, k))}" for k in keys]
    return (f'<div class="prompt"><h3>{_e(result.prompt)}</h3>'
            f'<div class="muted">seed {_e(result.seed)}</div>'
            f"<p>delta of mean score (LoRA − base): {', '.join(deltas) or 'no scores'}</p>"
            f'<div class="sides">{_inputs(result.input_images)}'
            f'{_side("base", result.base_images, result.base_scores, keys)}'
            f'{_side("LoRA", result.lora_images, result.lora_scores, keys)}</div></div>')


def _inputs(images: list[np.ndarray]) -> str:
    """The input images of an edit, left of what base and LoRA made of them."""
    if not images:
        return ""
    figures = "".join(f"<figure>{_sample_img(f'input {i}', image)}<figcaption>input</figcaption></figure>"
                      for i, image in enumerate(images))
    return f'<div><b>input</b><div class="images">{figures}</div></div>'
