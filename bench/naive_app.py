"""The naive baseline, written the way the seed articles do it: one Flask handler that
hashes, GETs, json.loads; on a miss calls the engine and SETEXes. Same engine, same
gunicorn settings as the service, so `make bench` compares like with like."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import redis
from flask import Flask, jsonify, request

from app.config import Settings
from app.engines.base import OcrRequest
from app.engines.paddle import PaddleOcrEngine
from app.imaging import decode_image

app = Flask(__name__)
cache = redis.Redis.from_url(os.environ["REDIS_URL"])
engine = PaddleOcrEngine.from_settings(Settings.from_env())
engine.prepare()  # keeps gunicorn's SIGTERM handling, as the service does
engine.load()


@app.post("/ocr")
def ocr():  # type: ignore[no-untyped-def]
    data = base64.b64decode(request.get_json()["image"])
    key = "naive:" + hashlib.md5(data).hexdigest()
    cached = cache.get(key)
    if cached:
        return jsonify(json.loads(cached))
    image = decode_image(data, 60_000_000)
    result = engine.recognize(OcrRequest(data, image, engine.default_params)).to_dict()
    cache.setex(key, 86400, json.dumps(result))
    return jsonify(result)
