"""PaddleX's own basic-serving OCR app, the parity oracle: ``python tests/paddlex_reference.py
PORT MODEL_WORK_DIR``.

It serves ``paddlex.inference.serving.basic_serving.create_pipeline_app`` (unmodified) with
uvicorn on 127.0.0.1:PORT, over the PaddleOCR pipeline our engine builds: the same local
PP-OCRv4 models (generated ``inference.yml``), the same Paddle Inference settings
(``app.engines.paddle.pipeline_kwargs``) and our default textline-orientation switch.
Only ``Serving: visualize`` and the pipeline's defaults come from upstream.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PADDLE_PDX_DISABLE_MODEL_SOURCE_CHECK", "True")


class _DefaultOrientation:
    """The pipeline, with our default for ``use_textline_orientation`` when a request names none.

    The orientation model must be loaded for requests that switch it on, and upstream's
    pipeline then defaults to using it; ours defaults to OCR_TEXTLINE_ORIENTATION.
    """

    def __init__(self, pipeline: Any, default: bool) -> None:
        self._pipeline, self._default = pipeline, default

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_textline_orientation") is None:
            kwargs["use_textline_orientation"] = self._default
        return self._pipeline.predict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)


def main() -> None:
    port, work_dir = int(sys.argv[1]), sys.argv[2]
    from paddleocr import PaddleOCR
    from paddlex.inference.serving.basic_serving import create_pipeline_app, run_server

    from app.config import Settings
    from app.engines import paddle_models
    from app.engines.paddle import pipeline_kwargs

    settings = Settings.from_env({}).with_overrides(ocr_work_dir=work_dir)
    models = paddle_models.resolve("", work_dir, with_cls=True)
    p = settings.ocr.params()
    ocr = PaddleOCR(
        **pipeline_kwargs(settings.paddle, models),
        text_det_limit_side_len=p.det_limit_side_len,
        text_det_limit_type=p.det_limit_type,
        text_det_thresh=p.det_thresh,
        text_det_box_thresh=p.det_box_thresh,
        text_det_unclip_ratio=p.det_unclip_ratio,
    )
    pipeline = _DefaultOrientation(ocr.paddlex_pipeline, p.textline_orientation)
    app = create_pipeline_app(pipeline, dict(ocr._merged_paddlex_config))
    run_server(app, host="127.0.0.1", port=port)


if __name__ == "__main__":
    main()
