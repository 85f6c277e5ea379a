"""The OCR parameters of a request that sets none: ``Settings.ocr``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env
from app.vocabulary import DETECTION_PARAMS, OcrParams

_PARAMS = OcrParams()  # the detection parameters' defaults (vocabulary.DETECTION_PARAMS)


@dataclass(frozen=True)
class OcrSettings(Section):
    TITLE = "OCR parameters (defaults)"

    det_limit_side_len: int = env(
        "OCR_DET_LIMIT_SIDE_LEN",
        e.integer(32, 8192),
        _PARAMS.det_limit_side_len,
        "detection input side",
    )
    det_limit_type: str = env(
        "OCR_DET_LIMIT_TYPE", e.choice("max", "min"), _PARAMS.det_limit_type, "detection limit type"
    )
    det_thresh: float = env(
        "OCR_DET_THRESH", e.number(0.0, 1.0), _PARAMS.det_thresh, "detection pixel threshold"
    )
    det_box_thresh: float = env(
        "OCR_DET_BOX_THRESH", e.number(0.0, 1.0), _PARAMS.det_box_thresh, "detection box threshold"
    )
    det_unclip_ratio: float = env(
        "OCR_DET_UNCLIP_RATIO",
        e.number(0.1, 10.0),
        _PARAMS.det_unclip_ratio,
        "detection unclip ratio",
    )
    textline_orientation: bool = env(
        "OCR_TEXTLINE_ORIENTATION",
        e.boolean,
        _PARAMS.textline_orientation,
        "textline orientation classification",
    )
    rec_score_thresh: float = env(
        "OCR_REC_SCORE_THRESH",
        e.number(0.0, 1.0),
        0.5,
        "the default line filter of `/v1/ocr` (`min_score`) and of the pipeline's answer",
    )

    def params(self) -> OcrParams:
        """The canonical parameters of a request that sets none."""
        return OcrParams(**{name: getattr(self, name) for name in DETECTION_PARAMS})
