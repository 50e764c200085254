"""OCR reward (docs/ALGORITHM.md section 8): how well the text rendered in the image matches the target.

Text is read with RapidOCR (PP-OCR models on onnxruntime) from the ONNX files bundled in the
``rapidocr`` wheel, so nothing is ever downloaded. The score is ``text_match.ocr_score`` of the
recognised text against ``text_match.target_text``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import rapidocr
from PIL import Image
from rapidocr import RapidOCR
from rapidocr.utils.output import RapidOCROutput

from components.rewards.arguments import OcrArgs
from components.rewards.base import PointwiseReward
from components.rewards.text_match import ocr_score, target_text

# The models rapidocr 3.10 selects by default, shipped inside its wheel. Passing their paths
# explicitly makes rapidocr skip its model resolver and downloader entirely.
BUNDLED_MODELS = {
    "Det": "PP-OCRv6_det_small.onnx",
    "Rec": "PP-OCRv6_rec_small.onnx",
    "Cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",
}
# Detection runs with the long side limited to this (PaddleOCR's classic default, which upstream
# FlowGRPO used). rapidocr's own default scales the *short* side up to 736, so a thin strip turns
# into an enormous input (a 1 x 512 image took two minutes); bounding the long side bounds the cost.
DET_MAX_SIDE = 960
# Images whose short side is below this are enlarged first: the detector works on a stride-32 grid
# and finds nothing in smaller inputs, and rapidocr's own enlargement (short side to 30 px) does not
# cap the long side either.
MIN_SIDE = 64


def bundled_model_dir() -> Path:
    return Path(rapidocr.__file__).parent / "models"


def _enlarge_small(image: np.ndarray) -> np.ndarray:
    """Scale up so the short side reaches ``MIN_SIDE`` (the long side capped at ``DET_MAX_SIDE``),
    then pad any remaining shortfall with edge pixels, which adds no text-like structure."""
    h, w = image.shape[:2]
    if min(h, w) >= MIN_SIDE:
        return image
    scale = min(MIN_SIDE / min(h, w), max(DET_MAX_SIDE / max(h, w), 1.0))
    if scale > 1.0:
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        image = np.asarray(Image.fromarray(image).resize(size, Image.Resampling.BICUBIC))
        h, w = image.shape[:2]
    return np.pad(image, ((0, max(0, MIN_SIDE - h)), (0, max(0, MIN_SIDE - w)), (0, 0)), mode="edge")


class OcrReward(PointwiseReward):
    """``1 - edit_distance / len(target)`` between the text OCR reads in the image and the target
    (the quoted text of the prompt, or ``metadata["ground_truth"]``). Arguments: ``OcrArgs`` (generated text
    is rarely upside down, so the direction classifier is off by default).
    """

    name = "ocr"
    Args = OcrArgs

    def __init__(self, args: OcrArgs | None = None) -> None:
        args = OcrArgs() if args is None else args
        paths = {task: bundled_model_dir() / file for task, file in BUNDLED_MODELS.items()}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"ocr: rapidocr's bundled models are missing ({', '.join(missing)}); "
                                    f"install the rapidocr version this reward was written for (3.10)")
        self._params: dict[str, Any] = {
            "Global.log_level": "error",  # rapidocr warns on every image without text
            "Global.text_score": args.min_confidence,
            "Global.use_cls": args.use_angle_cls,
            "Det.limit_type": "max",
            "Det.limit_side_len": DET_MAX_SIDE,
            **{f"{task}.model_path": str(path) for task, path in paths.items()},
        }
        self._engine: RapidOCR | None = None
        # Guards engine creation and use: the reward server may score from several threads, and
        # rapidocr does not document its pipeline as thread-safe (onnxruntime already uses all cores).
        self._lock = threading.Lock()

    def recognize(self, image: np.ndarray) -> str:
        """All text boxes found in an RGB uint8 image, in reading order, joined by spaces."""
        if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
            raise ValueError(f"expected a uint8 RGB image (H, W, 3), got {image.dtype} {image.shape}")
        if 0 in image.shape:
            raise ValueError(f"empty image of shape {image.shape}")
        # rapidocr takes arrays as OpenCV-style BGR.
        bgr = np.ascontiguousarray(_enlarge_small(image)[..., ::-1])
        with self._lock:
            if self._engine is None:
                self._engine = RapidOCR(params=dict(self._params))
            result = self._engine(bgr)
        # Any other output type means a stage failed after detection (rapidocr logs and swallows it);
        # reporting that as "no text" would score the image 0 instead of recording a failure.
        if not isinstance(result, RapidOCROutput):
            raise RuntimeError(f"rapidocr returned no recognition result ({type(result).__name__})")
        return " ".join(result.txts or ())

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        return ocr_score(self.recognize(image), target_text(prompt, metadata))
