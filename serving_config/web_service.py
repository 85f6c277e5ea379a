"""The Paddle Serving 0.9.0 pipeline of the sidecar (docker/Dockerfile.serving): PP-OCRv4
detection then recognition, answering in PaddleOCR's pdserving form (key ``result``, value the
``str()`` of ``[[(text, score), box], ...]``; see PaddleOCR deploy/pdserving, which this follows
in behaviour). Both ops run Paddle Inference in-process (``client_type: local_predictor``);
``./config.yml`` (written by docker/serving-entrypoint.sh) sets ports, processes and devices.
"""

import base64
import logging
import math
import os

import cv2
import numpy as np
import paddle.inference as paddle_infer
from paddle_serving_app.reader import DBPostProcess, FilterBoxes, GetRotateCropImage, SortedBoxes
from paddle_serving_server.web_service import Op, WebService

_LOGGER = logging.getLogger(__name__)
HERE = os.path.dirname(os.path.abspath(__file__))
DICT_PATH = os.environ.get("SERVING_REC_DICT", os.path.join(HERE, "ppocr_keys_v1.txt"))

DET_LIMIT_SIDE_LEN = 960
DET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
DET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
REC_HEIGHT, REC_MIN_WIDTH = 48, 320
MIN_SCORE = 0.5

# On AVX2 CPUs without AVX-512, Paddle 2.6's oneDNN kernel for self_attention_fuse_pass dies
# with SIGILL in the recognition model when IR optimisation is on. Removing that one pass keeps
# the optimised speed (turning IR optimisation off costs 3-4x). paddle_serving_app's
# LocalPredictor calls paddle_infer.create_predictor(config) at load time in each op process.
_create_predictor = paddle_infer.create_predictor


def _create_predictor_without_sigill_pass(config):  # type: ignore[no-untyped-def]
    config.delete_pass("self_attention_fuse_pass")
    return _create_predictor(config)


paddle_infer.create_predictor = _create_predictor_without_sigill_pass


def _only_value(fetch_dict):  # type: ignore[no-untyped-def]
    """The model's single output, whatever name the converter gave it."""
    (value,) = [v for k, v in fetch_dict.items() if not k.endswith(".lod")]
    return value


class DetOp(Op):
    def init_op(self):  # type: ignore[no-untyped-def]
        self.post = DBPostProcess(
            {"thresh": 0.3, "box_thresh": 0.6, "max_candidates": 1000, "unclip_ratio": 1.5}
        )
        self.filter = FilterBoxes(3, 3)
        self.images = {}

    def preprocess(self, input_dicts, data_id, log_id):  # type: ignore[no-untyped-def]
        ((_, input_dict),) = input_dicts.items()
        raw = base64.b64decode(input_dict["image"].encode("utf8"))
        image = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
        if image is None:
            raise ValueError("the image could not be decoded")
        height, width = image.shape[:2]
        ratio = min(1.0, DET_LIMIT_SIDE_LEN / max(height, width))
        new_h = max(32, int(round(height * ratio / 32)) * 32)
        new_w = max(32, int(round(width * ratio / 32)) * 32)
        resized = cv2.resize(image, (new_w, new_h))
        norm = (resized.astype(np.float32) / 255.0 - DET_MEAN) / DET_STD
        self.images[data_id] = (image, new_h / height, new_w / width)
        return {"x": norm.transpose(2, 0, 1)[np.newaxis].copy()}, False, None, ""

    def postprocess(self, input_dicts, fetch_dict, data_id, log_id):  # type: ignore[no-untyped-def]
        image, ratio_h, ratio_w = self.images.pop(data_id)
        (boxes,) = self.post(_only_value(fetch_dict), [[ratio_h, ratio_w]])
        boxes = self.filter(boxes, image.shape) if len(boxes) else np.zeros((0, 4, 2))
        return {"image": image, "dt_boxes": boxes}, None, ""


class RecOp(Op):
    def init_op(self):  # type: ignore[no-untyped-def]
        with open(DICT_PATH, encoding="utf-8") as fh:
            characters = [line.rstrip("\r\n") for line in fh]
        # CTC: index 0 is the blank; PP-OCRv4 appends the space character.
        self.characters = ["", *characters, " "]
        self.crop = GetRotateCropImage()
        self.sort = SortedBoxes()
        self.boxes = {}

    def preprocess(self, input_dicts, data_id, log_id):  # type: ignore[no-untyped-def]
        ((_, input_dict),) = input_dicts.items()
        image, boxes = input_dict["image"], input_dict["dt_boxes"]
        boxes = self.sort(np.array(boxes, dtype=np.float32)) if len(boxes) else []
        self.boxes[data_id] = boxes
        if not boxes:
            return {}, True, None, ""
        crops = [self.crop(image, box.copy()) for box in boxes]
        max_ratio = max(REC_MIN_WIDTH / REC_HEIGHT, *(c.shape[1] / c.shape[0] for c in crops))
        width = int(math.ceil(REC_HEIGHT * max_ratio))
        batch = np.zeros((len(crops), 3, REC_HEIGHT, width), dtype=np.float32)
        for i, crop in enumerate(crops):
            w = min(width, int(math.ceil(REC_HEIGHT * crop.shape[1] / crop.shape[0])))
            resized = cv2.resize(crop, (w, REC_HEIGHT)).astype(np.float32)
            batch[i, :, :, :w] = ((resized / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)
        return {"x": batch}, False, None, ""

    def postprocess(self, input_dicts, fetch_dict, data_id, log_id):  # type: ignore[no-untyped-def]
        boxes = self.boxes.pop(data_id)
        lines = []
        if boxes:
            probs = _only_value(fetch_dict)
            for box, (text, score) in zip(boxes, self._decode(probs)):
                if text and score >= MIN_SCORE:
                    lines.append([(text, score), [[float(x), float(y)] for x, y in box]])
        return {"result": str(lines)}, None, ""

    def _decode(self, probs):  # type: ignore[no-untyped-def]
        """Greedy CTC: best class per step, repeats collapsed, blanks dropped."""
        out = []
        for row in probs:
            index, best = row.argmax(axis=1), row.max(axis=1)
            keep = index != 0
            keep[1:] &= index[1:] != index[:-1]
            text = "".join(self.characters[i] for i in index[keep])
            score = float(best[keep].mean()) if keep.any() else 0.0
            out.append((text, round(score, 6)))
        return out


class OcrService(WebService):
    def get_pipeline_response(self, read_op):  # type: ignore[no-untyped-def]
        det = DetOp(name="det", input_ops=[read_op])
        return RecOp(name="rec", input_ops=[det])


if __name__ == "__main__":
    service = OcrService(name="ocr")
    service.prepare_pipeline_config("config.yml")
    service.run_service()
