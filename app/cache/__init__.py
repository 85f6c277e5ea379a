"""The cache: keys, value codec, the Redis tier with its circuit breaker, and the front door.

Read it like dogpile.cache: ``region.OcrCache.get_or_compute`` is the one entry point.
"""
