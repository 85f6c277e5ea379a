"""Asynchronous document jobs: their store, the engines' driver, the callback."""
