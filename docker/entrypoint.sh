#!/bin/sh
# Container entry point of docker/Dockerfile and docker/Dockerfile.gpu (under tini):
#   entrypoint.sh [serve|front|engine|edge|check-config|prepare-models]   (default: serve)
# The command selects the role (docs/DEPLOYMENT.md#roles): `serve` runs everything on one
# machine, `front` the edge and the front workers (no engine), `engine` the miss queue's
# consumer with the OCR engine (port ENGINE_PORT), `edge` nginx alone (the Kubernetes front
# pod's second container). Each runs in the foreground. `exec` makes it this
# process, so the SIGTERM that tini/docker/kubelet forwards reaches it directly: the front's
# server (granian) stops accepting, finishes in-flight requests (within REQUEST_TIMEOUT_SECONDS)
# and the command exits 0.
set -eu

# Run from the directory that holds the `app` package (/opt/ocr in the image).
cd "$(dirname "$0")/.."

# paddlex writes ~/.paddlex, ~/.cache at start-up; HOME is under the writable /tmp.
mkdir -p "${HOME:?HOME must be set}"

if [ "$#" -eq 0 ]; then
    set -- serve
fi

# prometheus_client's multiprocess folder (the image's PROMETHEUS_MULTIPROC_DIR, under /tmp):
# `serve` and `front` prepare their own; an engine container's one process starts from an empty
# one, since a restarted container finds its predecessor's files in the pod's /tmp.
if [ "$1" = engine ] && [ -n "${PROMETHEUS_MULTIPROC_DIR:-}" ]; then
    mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
    rm -f "$PROMETHEUS_MULTIPROC_DIR"/*.db
fi
exec python -m app "$@"
