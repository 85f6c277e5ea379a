"""Cache keys: ``{prefix}:{schema}:{engine_fingerprint}:{task}:{{md5(image bytes)}}``.

MD5 is what the design card asks for; it is not collision-resistant, so every entry also
stores the SHA-256 of its input and reads compare it (see ``codec``). The MD5 segment is a
Redis Cluster hash tag, so an entry and its companions (its single-flight lease) share a
slot and every variant of one image lives on one node.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

# Bump when the key layout or the entry envelope changes.
KEY_SCHEMA = "v1"


@dataclass(frozen=True)
class ImageDigest:
    """SHA-256 always (the L1 tier and the collision check need it); MD5 on demand (only
    the Redis key does, and an L1 hit never computes it)."""

    data: bytes = field(repr=False)
    sha256: str

    @property
    def md5(self) -> str:
        cached = self.__dict__.get("_md5")
        if cached is None:
            cached = hashlib.md5(self.data).hexdigest()
            object.__setattr__(self, "_md5", cached)
        return cached


def digest_image(data: bytes) -> ImageDigest:
    return ImageDigest(data, hashlib.sha256(data).hexdigest())


def build_key(prefix: str, engine_fingerprint: str, task: str, digest: ImageDigest) -> str:
    return f"{prefix}:{KEY_SCHEMA}:{engine_fingerprint}:{task}:{{{digest.md5}}}"


def lease_key(key: str) -> str:
    """The single-flight lease of ``key`` (same hash tag, same slot)."""
    return f"{key}:lease"


def done_channel(prefix: str, key: str) -> str:
    """Pub/sub channel announcing that ``key``'s computation ended."""
    return f"{prefix}:done:{key}"


def purge_channel(prefix: str) -> str:
    """Pub/sub channel telling every process to drop its L1 after a purge."""
    return f"{prefix}:purge"
