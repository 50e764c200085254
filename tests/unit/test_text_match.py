"""The OCR text formula against hand-computed cases (docs/ALGORITHM.md section 8)."""

import pytest

from components.rewards.text_match import levenshtein, normalize, ocr_score, target_text


def test_target_prefers_ground_truth_then_first_quotes():
    assert target_text('a sign saying "Open Late" and "Closed"', {}) == "Open Late"
    assert target_text('a sign saying "Open"', {"ground_truth": "Shut"}) == "Shut"
    assert target_text("no quotes here", {}) == ""
    assert target_text('an empty sign ""', {}) == ""


@pytest.mark.parametrize(("a", "b", "d"), [("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3),
                                           ("flaw", "lawn", 2), ("same", "same", 0)])
def test_levenshtein(a, b, d):
    assert levenshtein(a, b) == d == levenshtein(b, a)


def test_normalize_lowercases_and_drops_all_whitespace():
    assert normalize(" Open \t Late\n") == "openlate"


@pytest.mark.parametrize(
    ("recognized", "target", "expected"),
    [
        ("OPEN LATE", "open late", 1.0),          # normalisation
        ("xx open late yy", "Open Late", 1.0),    # substring -> distance 0
        ("opem late", "open late", 1 - 1 / 8),     # one substitution over 8 normalised chars
        ("zzzzzzzzzzzzzzzzzzzz", "open", 0.0),    # distance capped at len(target)
        ("", "open", 0.0),                         # blank image with a non-empty target
        ("", "", 1.0),                             # empty target, nothing recognised
        ("stray", "", 0.0),                        # empty target, text recognised
        ("   ", "", 1.0),
    ],
)
def test_ocr_score(recognized, target, expected):
    assert ocr_score(recognized, target) == pytest.approx(expected)
