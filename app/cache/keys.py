"""Cache keys: ``{prefix}:{schema}:{engine_fingerprint}:{task}:{{md5(image bytes)}}``.

MD5 is what the design card asks for; it is not collision-resistant, so every entry also
stores the SHA-256 of its input and reads compare it (see ``codec``). The MD5 segment is a
Redis Cluster hash tag, so an entry and its companions (its error markers) share a
slot and every variant of one image lives on one node.

Cache state apart from service state. Everything the cache holds for a namespace (entries,
their error markers and reference pictures, the pixel, similarity and extraction indexes,
line readings, page lists) lives under ``{prefix}:v<schema>:``, and a purge's SCAN pattern
(``purge_pattern``) reaches only that root, whatever the namespace or MD5. The service's
own state lives elsewhere and no purge reaches it: quotas ``{base}:quota:``, rate limits
``{base}:ratelimit:`` (tenants' request rates and failed-key budgets too), a purge's
replication check ``{base}:purgesync:``, the miss queue
under its hash tag ``{{base}:dispatch:...}``; pub/sub channels (``{base}:done:``,
``{base}:purge``) are no keys. A new name for service state must not start with
``{prefix}:v`` and a digit; a new cache name must (or a purge leaves it behind).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from app.vocabulary import OcrParams

# Bump when the key layout or the entry envelope changes.
KEY_SCHEMA = "v1"
# Every entry schema's root (``v1``, ``v2``...): what a purge may reach below a prefix.
ENTRY_ROOT_GLOB = "v[0-9]"
DISPATCH_SCHEMA = "v3"  # the global miss queue's key layout (app/queue/)


@dataclass(frozen=True)
class QueueKeys:
    """Every name of one global miss queue, all under its hash tag (one slot, so one script
    reads any of them): a stream per lane (a tenant's tickets; ``~`` the default tenant's,
    and every ticket's with ``DISPATCH_FAIRNESS=fifo``), the ring of lanes with waiting
    tickets and their deficits, shares and ticket costs (deficit round robin,
    ``app/engine_side/scheduler.py``), every lane that has a stream, the doorbell that wakes an
    idle engine and the one that wakes a busy engine's interjector, the live-engine register
    and the ticket markers and images. Any of them may be evicted under ``allkeys-lru``:
    ``app/queue/requester.py`` says what that costs. The key strings keep their first names
    (``jobs:{lane}``, ``job:{entry}:{sha256}``): renaming them would split the queue of a
    rolling update."""

    tag: str

    def stream(self, lane: str) -> str:
        return f"{self.tag}:jobs:{lane}"

    @property
    def stream_prefix(self) -> str:
        return f"{self.tag}:jobs:"

    @property
    def engines(self) -> str:
        return f"{self.tag}:engines"

    @property
    def ring(self) -> str:
        return f"{self.tag}:ring"

    @property
    def deficits(self) -> str:
        return f"{self.tag}:deficits"

    @property
    def shares(self) -> str:
        return f"{self.tag}:shares"

    @property
    def costs(self) -> str:
        return f"{self.tag}:costs"

    @property
    def lanes(self) -> str:
        return f"{self.tag}:lanes"

    @property
    def bell(self) -> str:
        return f"{self.tag}:bell"

    @property
    def interject_bell(self) -> str:
        return f"{self.tag}:interject"

    @property
    def engine_bell_prefix(self) -> str:
        """One engine's own interjector bell is this and its consumer: rung by another
        engine's interjector that heard a ring only this one may answer (``queue_take.lua``)."""
        return f"{self.tag}:interject:"

    @property
    def help_bell(self) -> str:
        """With several shards: another shard's number, pushed by a front whose miss waits
        there behind busy engines (or none), for an idle engine of this shard to take it
        from that shard (``app/engine_side/feeders.py``)."""
        return f"{self.tag}:help"

    @property
    def lost_latch(self) -> str:
        """Set for a few seconds by the first engine that announces the queue's keys lost
        (``heartbeat.py``): one announcement, not one per engine process."""
        return f"{self.tag}:lost"

    def trace(self, ticket_id: str) -> str:
        """The W3C context of the traced request that queued ticket ``ticket_id``, for the
        requests that join it (their spans link to its trace), while the ticket's marker lives."""
        return f"{self.tag}:trace:{ticket_id}"

    def marker(self, entry: str, sha256: str) -> str:
        """Which ticket computes ``entry`` for the image ``sha256`` (its id), while one does.
        Per SHA-256: two images with one MD5 share a key, never a ticket."""
        return f"{self.tag}:job:{entry}:{sha256}"

    def image(self, entry: str, sha256: str) -> str:
        """The image bytes of the tickets that compute ``entry`` for ``sha256`` (format 2:
        written beside the ticket, not in it, so they never pass through the queue's Lua
        scripts; ``app/queue/ticket.py``), for as long as its marker lives."""
        return f"{self.tag}:image:{entry}:{sha256}"


@lru_cache(maxsize=64)
def shard_tag(tag: str, shard: int, shards: int) -> str:
    """``tag`` (``{...}``) for shard ``shard`` of ``shards``: the first suffix ``:s<i>.<n>``
    whose hash slot falls in the middle eight tenths of the shard's range of slots, clear of
    its edges (where tools that split the slots round differently may disagree): a few
    tries, about ``shards``."""
    inner = tag[1:-1]
    n = 0
    while True:
        candidate = f"{inner}:s{shard}.{n}"
        place = key_slot(candidate.encode()) * shards / REDIS_CLUSTER_HASH_SLOTS - shard
        if 0.1 < place < 0.9:
            return f"{{{candidate}}}"
        n += 1


def shard_of(entry: str, shards: int) -> int:
    """Which queue shard computes ``entry`` (a cache key): by a hash of the key, so one
    image always meets one shard (its single-flight marker lives there) and distinct
    images spread evenly."""
    return zlib.crc32(entry.encode()) % shards if shards > 1 else 0


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


def known_digest(md5: str, sha256: str) -> ImageDigest:
    """The digest of an image not at hand (a PDF's page named by the document tier)."""
    digest = ImageDigest(b"", sha256)
    object.__setattr__(digest, "_md5", md5)
    return digest


def digest_image(data: bytes) -> ImageDigest:
    return ImageDigest(data, hashlib.sha256(data).hexdigest())


def build_key(prefix: str, engine_fingerprint: str, task: str, digest: ImageDigest) -> str:
    return f"{prefix}:{KEY_SCHEMA}:{engine_fingerprint}:{task}:{{{digest.md5}}}"


def done_channel(prefix: str, key: str) -> str:
    """Pub/sub channel announcing that ``key``'s computation ended."""
    return f"{prefix}:done:{key}"


def purge_channel(prefix: str) -> str:
    """Pub/sub channel telling every process to drop its L1 after a purge."""
    return f"{prefix}:purge"


def queue_lost_channel(prefix: str) -> str:
    """Pub/sub channel telling every waiting miss that the queue's keys were lost (an
    engine found its own report gone from the live register): check your ticket now."""
    return f"{prefix}:queue-lost"


def glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis SCAN/KEYS pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class KeySpace:
    """Every name this service gives Redis for one engine, in one place: the entry key, its
    L1 key, its done channel, a tenant's prefix, the purge pattern and channel, the miss
    queue's keys.

    ``{prefix}`` is ``CACHE_KEY_PREFIX``, or ``CACHE_KEY_PREFIX.{tenant}`` for a tenant; the
    pub/sub channels always use the base prefix (one channel space per deployment).
    """

    def __init__(self, base_prefix: str, engine_fingerprint: str) -> None:
        self.base_prefix = base_prefix
        self.fingerprint = engine_fingerprint

    def prefix(self, namespace: str = "") -> str:
        return f"{self.base_prefix}.{namespace}" if namespace else self.base_prefix

    @staticmethod
    def task(params: OcrParams) -> str:
        """The task segment: the task and the digest of its effective parameters, so equal
        parameters share entries however a protocol spelled them."""
        return f"{params.task}-{params.digest()}"

    def entry(self, digest: ImageDigest, task: str, namespace: str = "") -> str:
        return build_key(self.prefix(namespace), self.fingerprint, task, digest)

    def l1(self, digest: ImageDigest, task: str, namespace: str = "") -> tuple[str, ...]:
        """The in-process key: the SHA-256, so an L1 hit never computes the MD5."""
        return self.l1_for(digest.sha256, task, namespace)

    def l1_for(self, sha256: str, task: str, namespace: str = "") -> tuple[str, ...]:
        return (self.prefix(namespace), self.fingerprint, task, sha256)

    def done(self, entry: str) -> str:
        return done_channel(self.base_prefix, entry)

    def done_pattern(self) -> str:
        """What the notifier subscribes to: every entry's done channel."""
        return done_channel(self.base_prefix, "*")

    def pixel_bucket(self, bucket: str, task: str, namespace: str = "") -> str:
        """One bucket of the pixel tier's index (a hash: canonical pixels -> the entry that
        answered them); ``px2``: the second format (the first, ``pixel:{digest}`` strings,
        is neither read nor written any more)."""
        return f"{self._scope(task, namespace)}:px2:{bucket}"

    def similar_band(self, band: int, value: str, task: str, namespace: str = "") -> str:
        """One band of a perceptual hash -> the recent entries whose hash has that band."""
        return f"{self._scope(task, namespace)}:simband:{band}:{value}"

    @staticmethod
    def similar_ref(entry: str) -> str:
        """An entry's reference picture for the similarity check (same hash tag and slot as
        the entry, so a purge of one image removes it too)."""
        return f"{entry}:simref"

    def line(self, schema: str, context: str, digest: str, namespace: str = "") -> str:
        """A text-line crop's reading (line reuse, ``app/cache/lines.py``): per engine (the
        fingerprint holds the models, versions, device and redaction policy), namespace,
        line schema (the line format's version and what else shapes a reading after the
        crop's digest, ``line1:{digest}``) and recognition context; no hash tag (a page's
        lines spread over a cluster's nodes)."""
        fp = self.fingerprint
        return f"{self.prefix(namespace)}:{KEY_SCHEMA}:{fp}:{schema}:{context}:{digest}"

    def entry_scope(self, task: str, namespace: str = "") -> str:
        """What every entry key of this engine, task and namespace starts with (``:``
        included): an index pointer outside it is refused."""
        return self._scope(task, namespace) + ":"

    def _scope(self, task: str, namespace: str) -> str:
        return f"{self.prefix(namespace)}:{KEY_SCHEMA}:{self.fingerprint}:{task}"

    def document(self, digest: ImageDigest, spec: str, namespace: str = "") -> str:
        """A document's page list (``app/cache/documents.py``): per renderer ``spec``, not
        per engine (its pages are images; their entries are per engine). The document's MD5
        is its hash tag, so a purge of that MD5 removes it."""
        return f"{self.prefix(namespace)}:{KEY_SCHEMA}:doc:{spec}:{{{digest.md5}}}"

    def purge_pattern(self, namespace: str = "", md5: str | None = None) -> str:
        """A namespace's cache keys, or one image's in it (its hash tag): only those under
        ``{prefix}:v<schema>:`` (every entry schema's, an older one's too), never the
        service's state (quotas, rate limits, the queue: module docstring). The prefix is
        escaped: ``CACHE_KEY_PREFIX`` may hold a glob's ``*``, ``?`` or ``[``."""
        root = f"{glob_escape(self.prefix(namespace))}:{ENTRY_ROOT_GLOB}"
        return f"{root}*{{{glob_escape(md5)}}}*" if md5 else f"{root}*"

    def purge_channel(self) -> str:
        return purge_channel(self.base_prefix)

    def queue_lost_channel(self) -> str:
        return queue_lost_channel(self.base_prefix)

    def purge_sync(self) -> str:
        """The start of the short-lived key each master writes after a purge's deletes, to
        WAIT for its replicas to have them (``app/cache/purging.py``); a hash tag follows."""
        return f"{self.base_prefix}:purgesync:"

    def rate_limit(self, client: str) -> str:
        """One client address's rate-limit state (``app/cache/rate_limit.py``): per
        deployment (the base prefix), whatever the engine, task or tenant."""
        return f"{self.base_prefix}:ratelimit:{{{client or 'unknown'}}}"

    def quota(self, kind: str, tenant: str) -> str:
        """A tenant's quota state (``app/cache/quotas.py``: ``inflight``, ``engine``): per
        deployment, whatever the engine, so every front of one Redis counts one budget."""
        return f"{self.base_prefix}:quota:{kind}:{{{tenant or '~'}}}"

    def dispatch(self, writer: str = "") -> QueueKeys:
        """The global miss queue of this engine: one hash tag, one slot. Per fingerprint: a
        ticket is computed only by an engine whose results it may store. Per ``writer``
        (``Codec.writer``: which key seals new entries, "" for none): only by a process whose
        entries the requester can read, so fronts amid a key rotation never wait for an
        entry they cannot open. ``v3``: one lane per tenant, taken by deficit round robin
        (issue 26); replicas of an earlier release keep their own queue during a rolling
        upgrade, neither side reads the other's tickets."""
        scope = f"{self.fingerprint}:{writer}" if writer else self.fingerprint
        return QueueKeys(f"{{{self.base_prefix}:dispatch:{DISPATCH_SCHEMA}:{scope}}}")

    def dispatch_shards(self, writer: str, shards: int) -> tuple[QueueKeys, ...]:
        """The queue in ``shards`` shards (``DISPATCH_SHARDS``), each a queue of its own under
        its own hash tag, so several Redis Cluster masters share the queue's work. One shard
        is the queue of ``dispatch``, unchanged; shard i of several is that tag and a suffix
        picked so that its slot lies in the i-th of ``shards`` equal slot ranges (on a
        cluster whose masters own equal ranges in order, one master per shard)."""
        single = self.dispatch(writer)
        if shards == 1:
            return (single,)
        return tuple(QueueKeys(shard_tag(single.tag, i, shards)) for i in range(shards))

    @staticmethod
    def ticket_error(entry: str, ticket_id: str) -> str:
        """A short-lived marker: ticket ``ticket_id`` failed (never a cached result)."""
        return f"{entry}:error:{ticket_id}"

    def object(self, digest: ImageDigest, task: str, namespace: str = "") -> str:
        """The entry's name in the cold tier (L3), below its bucket prefix:
        ``{prefix}/{md5}/{schema}-{fingerprint}-{task}``. Object stores list by prefix only,
        so the namespace and then the MD5 come first: a purge of a namespace or of one
        image is one prefix listing (``object_prefix``)."""
        return f"{self.object_prefix(namespace, digest.md5)}{KEY_SCHEMA}-{self.fingerprint}-{task}"

    def object_prefix(self, namespace: str = "", md5: str | None = None) -> str:
        """A namespace's objects, or one image's objects in it (every engine and task)."""
        return f"{self.prefix(namespace)}/{md5}/" if md5 else f"{self.prefix(namespace)}/"
