#!/usr/bin/env bash
# make test-images: build every image and run it for real (tests/images/check_images.py).
# Brings up the Docker engine with the shared tool when no daemon answers, and on exit — pass,
# fail or interrupt — removes what the checks started; when it started the engine, it stops it
# (`container-engine.sh down`). Images and build layers are kept: re-runs build in seconds.
# Extra arguments go to pytest (e.g. -k cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."

SHARED=${OCR_SHARED_DIR:-../shared}
ENGINE=${CONTAINER_ENGINE:-$SHARED/tools/container-engine.sh}
PROJECT=ocr-test-images
started_engine=0

cleanup() {
    local rc=$?
    set +e
    if docker info >/dev/null 2>&1; then
        REDIS_PASSWORD=unused docker compose -p "$PROJECT" -f docker/docker-compose.yml \
            -f docker/compose.local.yml --profile serving --profile monitoring \
            down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
        REDIS_PASSWORD=unused docker compose -p "$PROJECT-l3" -f docker/docker-compose.yml \
            -f docker/compose.local.yml --profile l3 \
            down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
        ids=$(docker ps -aq --filter label=ocr-test-images=1)
        if [ -n "$ids" ]; then docker rm -f $ids >/dev/null; fi
    fi
    if [ "$started_engine" = 1 ]; then bash "$ENGINE" down; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! docker info >/dev/null 2>&1; then
    started_engine=1
fi
# Idempotent (about a second when everything is there): engine, compose plugin, base images.
bash "$ENGINE" up >/dev/null
SUITE=bullseye BASE_IMAGE=local/debian-python:bullseye REDIS_IMAGE='' bash "$ENGINE" up >/dev/null

start=$(date +%s)
set +e
.venv/bin/python -m pytest tests/images/check_images.py -p no:cacheprovider --timeout=1800 \
    -o addopts="" -q -ra -s "$@"
rc=$?
set -e
echo "make test-images: pytest exit $rc after $(( $(date +%s) - start )) s (measurements: .run/test-images/)"
exit "$rc"
