"""Input images of editing rows: where a reference points, the hostile-image checks, and the square the model
takes."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from components.dataset import input_images as ii
from components.errors import DataError


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize(("ref", "base", "expected"), [
    ("a.png", "/data/rows.jsonl", "/data/a.png"),
    ("img/a.png", "s3://bucket/sets/rows.jsonl", "s3://bucket/sets/img/a.png"),
    ("/abs/a.png", "/data/rows.jsonl", "/abs/a.png"),
    ("s3://other/a.png", "/data/rows.jsonl", "s3://other/a.png"),
    ("data:image/png;base64,AAAA", "/data/rows.jsonl", "data:image/png;base64,AAAA"),
    ("a.png", None, "a.png"),
])
def test_a_relative_reference_is_relative_to_the_file_that_names_it(ref, base, expected):
    assert ii.resolve(ref, base) == expected


def test_a_path_and_a_data_url_give_the_files_pixels(tmp_path):
    image = _image(9, 7)
    (tmp_path / "x.png").write_bytes(_png(image))
    url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    assert np.array_equal(ii.load_image(str(tmp_path / "x.png")), image)
    assert np.array_equal(ii.load_image(url), image)


@pytest.mark.parametrize(("content", "reason", "needle"), [
    (None, "image_missing", "does not exist"),
    (b"\x89PNG\r\n\x1a\n not really", "image_unreadable", "cannot decode"),
    (b"GIF89a" + bytes(40), "image_unreadable", "cannot decode"),
])
def test_a_missing_or_corrupt_image_is_refused_with_its_reason_and_the_row(tmp_path, content, reason, needle):
    path = tmp_path / "bad.png"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ii.InputImageError) as err:
        ii.load_row_images([str(path)], "the row 'make it red'")
    assert err.value.reason == reason and needle in str(err.value)
    assert str(err.value).startswith("the row 'make it red': input image ") and str(path) in str(err.value)


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(tmp_path, monkeypatch):
    monkeypatch.setattr(ii, "MAX_PIXELS", 20 * 20 - 1)
    path = tmp_path / "big.png"
    path.write_bytes(_png(_image(20, 20)))
    with pytest.raises(ii.InputImageError) as err:
        ii.decode(path.read_bytes(), str(path))
    assert err.value.reason == "image_too_large" and "400 pixels exceeds the limit of 399" in str(err.value)


@pytest.mark.parametrize(("h", "w", "ok"), [(32, 64, True), (32, 65, False), (16, 16, True), (15, 40, False)])
def test_sizes_past_two_to_one_or_under_a_quarter_of_the_resolution_are_refused(h, w, ok):
    assert (ii.size_problem(h, w, 64) is None) == ok


def test_the_square_is_the_centre_crop_and_then_the_lanczos_resize():
    image = _image(60, 40)
    assert np.array_equal(ii.square(image, 40), image[10:50])  # already the size: the crop alone
    wide = _image(40, 61, seed=1)
    expected = np.asarray(Image.fromarray(wide[:, 10:50]).resize((20, 20), Image.LANCZOS))
    assert np.array_equal(ii.square(wide, 20), expected)


def test_model_input_is_batch_images_channels_in_minus_one_to_one():
    rows = [[_image(16, 16, seed=i), _image(16, 16, seed=10 + i)] for i in range(3)]
    x = ii.model_input(rows, 16)
    assert x.shape == (3, 2, 3, 16, 16)
    assert x[1, 1, 2, 5, 7].item() == pytest.approx(rows[1][1][5, 7, 2] / 127.5 - 1)
    assert x.min() >= -1 and x.max() <= 1


def test_model_input_names_the_row_whose_image_the_model_cannot_take():
    with pytest.raises(DataError, match=r"^the row 'b': input image 10x40 px is more than 2:1"):
        ii.model_input([[_image(16, 16)], [_image(40, 10)]], 16, ["the row 'a'", "the row 'b'"])
    with pytest.raises(DataError, match="different numbers of input images"):
        ii.model_input([[_image(16, 16)], []], 16)
