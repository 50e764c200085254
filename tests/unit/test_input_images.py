"""Input images of editing rows: where a reference points, the hostile-image checks, and the square the model
takes."""

import base64
import io
import os
import re
import struct
import time
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image

from components.dataset import input_images as ii
from components.dataset.prepared import PromptRow
from components.errors import DataError


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize(("ref", "base", "expected"), [
    ("img/a.png", "s3://bucket/sets/rows.jsonl", "s3://bucket/sets/img/a.png"),
    ("./img/../a.png", "s3://bucket/sets/rows.jsonl", "s3://bucket/sets/a.png"),
    ("a.png", "s3://bucket/rows.jsonl", "s3://bucket/a.png"),
    ("data:image/png;base64,AAAA", "/data/rows.jsonl", "data:image/png;base64,AAAA"),
])
def test_a_relative_reference_is_relative_to_the_file_that_names_it(ref, base, expected):
    assert ii.resolve(ref, base) == expected


def test_a_local_reference_comes_back_real_and_inside_the_files_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(b"")
    (tmp_path / "link.png").symlink_to(tmp_path / "sub" / "a.png")  # a link that stays inside is followed
    base = str(tmp_path / "rows.jsonl")
    assert ii.resolve("sub/a.png", base) == ii.resolve("link.png", base) == str(tmp_path / "sub" / "a.png")


@pytest.mark.parametrize("ref", ["../outside/secret.png", "sub/../../outside/secret.png", "escape.png",
                                 "escdir/secret.png"])
def test_a_reference_that_leaves_the_files_folder_is_refused(tmp_path, ref):
    # Before: "../outside/secret.png" was read and copied into the prepared dataset.
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.png").write_bytes(b"")
    (tmp_path / "ds" / "sub").mkdir(parents=True)
    (tmp_path / "ds" / "escape.png").symlink_to(tmp_path / "outside" / "secret.png")
    (tmp_path / "ds" / "escdir").symlink_to(tmp_path / "outside")
    for allow_external in (False, True):  # the opt-in is for absolute paths and URIs, never for a way out
        with pytest.raises(ii.InputImageError) as err:
            ii.resolve(ref, str(tmp_path / "ds" / "rows.jsonl"), allow_external)
        assert err.value.reason == "image_outside" and f"input image {ref}: leads outside" in str(err.value)


@pytest.mark.parametrize("ref", ["../secret.png", "sub/../../secret.png", "..", "."])
def test_an_s3_reference_that_leaves_the_files_prefix_is_refused(ref):
    with pytest.raises(ii.InputImageError, match=f"input image {re.escape(ref)}: leads outside s3://bucket/ds"):
        ii.resolve(ref, "s3://bucket/ds/rows.jsonl", allow_external=True)


@pytest.mark.parametrize("ref", ["/abs/a.png", "s3://other/a.png", "file:///abs/a.png"])
def test_an_absolute_path_or_a_uri_needs_the_opt_in(ref):
    with pytest.raises(ii.InputImageError) as err:
        ii.resolve(ref, "/data/rows.jsonl")
    assert err.value.reason == "image_outside" and "data.allow_external_images: true" in str(err.value)
    assert ii.resolve(ref, "/data/rows.jsonl", allow_external=True) == ref


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


def test_training_names_the_row_whose_image_the_model_cannot_take(tmp_path):
    (tmp_path / "wide.png").write_bytes(_png(_image(10, 40)))
    with pytest.raises(DataError, match=r"^the row 'b': input image .*wide.png: 40x10 px is more than 2:1") as err:
        ii.load_row_images([str(tmp_path / "wide.png")], "the row 'b'", 16)
    assert err.value.reason == "image_size"
    assert ii.load_row_images([str(tmp_path / "wide.png")], "the row 'b'")[0].shape == (10, 40, 3)  # no model yet
    with pytest.raises(DataError, match="different numbers of input images"):
        ii.model_input([[_image(16, 16)], []], 16)

def _bomb(w: int, h: int) -> bytes:
    """A PNG of 57 bytes whose header says ``w`` x ``h``."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.fixture
def fresh_cache():
    ii._cache.clear()
    yield
    ii._cache.clear()


def test_one_file_is_one_cache_entry_however_it_is_named(tmp_path, monkeypatch, fresh_cache):
    # Before: one entry per path string; the same 4096 x 4096 PNG named 24 ways held 1.4 GB.
    image = _image(256, 256)
    (tmp_path / "a.png").write_bytes(_png(image))
    (tmp_path / "link.png").symlink_to(tmp_path / "a.png")
    os.link(tmp_path / "a.png", tmp_path / "hard.png")
    monkeypatch.chdir(tmp_path)
    ii.decode(_png(image), "warm-up")  # Pillow's plugins imported before measuring
    names = ["a.png", "./a.png", "././a.png", str(tmp_path / "a.png"), "link.png", "hard.png"]
    tracemalloc.start()
    try:
        held = [ii.load_image(name) for name in names]
        retained = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert all(h is held[0] for h in held) and np.array_equal(held[0], image)
    assert retained < 2 * image.nbytes  # one copy (before: six)


def test_the_cache_holds_at_most_its_bytes(tmp_path, monkeypatch, fresh_cache):
    image = _image(64, 64)
    monkeypatch.setattr(ii, "CACHE_BYTES", int(2.5 * image.nbytes))
    for i in range(5):
        (tmp_path / f"{i}.png").write_bytes(_png(_image(64, 64, seed=i)))
        ii.load_image(str(tmp_path / f"{i}.png"))
        assert ii._cache.nbytes <= ii.CACHE_BYTES
    assert ii._cache.nbytes == 2 * image.nbytes  # the two last used
    assert ii.load_image(str(tmp_path / "4.png")) is ii.load_image(str(tmp_path / "4.png"))
    assert np.array_equal(ii.load_image(str(tmp_path / "0.png")), _image(64, 64, seed=0))  # read again


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path):
    # Before: a 2 GiB sparse file named as an image was read whole (2.1 GB RSS, 5.9 s).
    path = tmp_path / "huge.png"
    with path.open("wb") as f:
        f.truncate(ii.MAX_IMAGE_BYTES + 1)  # sparse: no disk, no bytes to read but zeros
    start = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(ii.InputImageError) as err:
            ii.load_image(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.reason == "image_too_large"
    assert f"is {ii.MAX_IMAGE_BYTES + 1} bytes, over the limit of {ii.MAX_IMAGE_BYTES}" in str(err.value)
    assert peak < 2**20 and time.perf_counter() - start < 1
    url = "data:image/png;base64," + "A" * (ii.MAX_IMAGE_BYTES // 3 * 4 + 8)
    with pytest.raises(ii.InputImageError, match="over the limit") as err:
        ii.load_image(url)
    assert err.value.reason == "image_too_large"


def test_the_limits_take_what_the_families_take():
    from components.models.flux2.adapter import MAX_REFERENCES

    assert ii.MAX_IMAGES_PER_ROW == MAX_REFERENCES  # the most any family takes
    # an 8-bit RGB PNG at the pixel limit, stored uncompressed, is under the file-size limit
    assert 3 * ii.MAX_PIXELS + 4096 * 5 < ii.MAX_IMAGE_BYTES


def test_check_rows_refuses_what_training_refuses_naming_the_row(tmp_path, fresh_cache):
    (tmp_path / "ok.png").write_bytes(_png(_image(32, 32)))
    (tmp_path / "bomb.png").write_bytes(_bomb(30000, 30000))
    (tmp_path / "cut.png").write_bytes(_png(_image(32, 32))[:-200])
    (tmp_path / "wide.png").write_bytes(_png(_image(16, 40)))
    ok = PromptRow("ok", images=(str(tmp_path / "ok.png"),))
    ii.check_rows([ok, ok], 32)
    for bad, reason, needle in [
        ("bomb.png", "image_too_large", "exceeds limit of 178956970 pixels"),
        ("cut.png", "image_unreadable", "cannot decode image (OSError: image file is truncated"),
        ("wide.png", "image_size", "40x16 px is more than 2:1"),
    ]:
        row = PromptRow("make it red", images=(str(tmp_path / bad),))
        start = time.perf_counter()
        with pytest.raises(ii.InputImageError) as err:
            ii.check_rows([ok, row], 32)
        assert time.perf_counter() - start < 1
        assert err.value.reason == reason and needle in str(err.value)
        with pytest.raises(ii.InputImageError) as trained:  # what training raises as it encodes the row
            ii.model_input([ii.load_row_images(row.images, ii.describe(row), 32)], 32)
        assert str(err.value) == str(trained.value)
    many = PromptRow("make it red", images=(str(tmp_path / "ok.png"),) * 3000)
    with pytest.raises(ii.InputImageError, match=r"^the row 'make it red' .*: 3000 input images; a model takes at "
                                                 "most 4") as err:
        ii.check_rows([ok, many], 32)
    assert err.value.reason == "too_many_images"
    with pytest.raises(DataError, match=r"different numbers of input images \(\[0, 1\]\)"):
        ii.check_rows([ok, PromptRow("text")], 32)
