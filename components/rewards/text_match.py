"""The OCR reward's text formula (docs/ALGORITHM.md section 8), shared by the `ocr` reward and the VLM
judge's transcription mode."""

from __future__ import annotations

import re
from typing import Any

_QUOTED = re.compile(r'"([^"]*)"')


def target_text(prompt: str, metadata: dict[str, Any]) -> str:
    """The text the image should show: ``metadata["ground_truth"]`` if given, else the text between
    the first pair of double quotes in the prompt; "" when there is neither."""
    truth = metadata.get("ground_truth")
    if truth is not None:
        return str(truth)
    match = _QUOTED.search(prompt)
    return match.group(1) if match else ""


def normalize(text: str) -> str:
    """Lowercase with all whitespace removed."""
    return "".join(text.lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions), O(len(a) * len(b))."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognized: str, target: str) -> float:
    """``1 - dist / len(target)`` on normalised text; dist is 0 when the target is a substring of the
    recognised text, else the Levenshtein distance capped at ``len(target)``. An empty target scores 1.0
    when nothing was recognised and 0.0 otherwise."""
    rec, tgt = normalize(recognized), normalize(target)
    if not tgt:
        return 1.0 if not rec else 0.0
    dist = 0 if tgt in rec else min(levenshtein(rec, tgt), len(tgt))
    return 1.0 - dist / len(tgt)
