"""Cache keys: ``{prefix}:{schema}:{engine_fingerprint}:{task}:{md5(image bytes)}``.

MD5 is what the design card asks for; it is not collision-resistant, so every entry also
stores the SHA-256 of its input and reads compare it (see ``codec``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Bump when the key layout or the entry envelope changes.
KEY_SCHEMA = "v1"


@dataclass(frozen=True)
class ImageDigest:
    md5: str
    sha256: str


def digest_image(data: bytes) -> ImageDigest:
    return ImageDigest(hashlib.md5(data).hexdigest(), hashlib.sha256(data).hexdigest())


def build_key(prefix: str, engine_fingerprint: str, task: str, digest: ImageDigest) -> str:
    return f"{prefix}:{KEY_SCHEMA}:{engine_fingerprint}:{task}:{digest.md5}"
