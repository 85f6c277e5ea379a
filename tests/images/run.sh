#!/usr/bin/env bash
# make test-images: build every image and run it for real (tests/images/check_images.py), the
# two roles as separate compose services, one front and one engine (tests/images/check_roles.py),
# then the chaos subset on the compose stack of `make chaos` (tests/images/check_chaos.py).
# Brings up the Docker engine with the shared tool when no daemon answers. Before the checks
# and on exit — pass, fail or interrupt — removes what these checks start (the compose projects
# ocr-test-images*, the containers labelled ocr-test-images=1), so a run starts from whatever
# an earlier, interrupted one left. When it started the engine, it stops it on exit
# (`container-engine.sh down` stops every container of the daemon), unless other containers
# are on it then (another user's: `make chaos`, say): it is left running for them.
# Images and build layers are kept: re-runs build in seconds. Extra arguments go to pytest
# (e.g. -k cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
# One run at a time on this machine: a second one would remove the first one's containers.
exec 9>"${TMPDIR:-/tmp}/ocr-test-images.lock"
flock 9

SHARED=${OCR_SHARED_DIR:-../shared}
ENGINE=${CONTAINER_ENGINE:-$SHARED/tools/container-engine.sh}
PROJECT=ocr-test-images
started_engine=0

remove_ours() {
    REDIS_PASSWORD=unused docker compose -p "$PROJECT" -f docker/docker-compose.yml \
        -f docker/compose.local.yml --profile serving --profile monitoring \
        down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
    REDIS_PASSWORD=unused docker compose -p "$PROJECT-l3" -f docker/docker-compose.yml \
        -f docker/compose.local.yml --profile l3 \
        down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
    # One front and one engine (tests/images/check_roles.py).
    REDIS_PASSWORD=unused docker compose -p "$PROJECT-roles" -f docker/docker-compose.yml \
        -f docker/compose.local.yml down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
    # The chaos subset (tests/images/check_chaos.py, bench/chaos.py).
    REDIS_PASSWORD=unused L3_SECRET_ACCESS_KEY=unused docker compose -p "$PROJECT-chaos" \
        -f docker/docker-compose.yml -f docker/compose.local.yml -f docker/compose.chaos.yml \
        --profile l3 down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
    local ids
    ids=$(docker ps -aq --filter label=ocr-test-images=1)
    if [ -n "$ids" ]; then docker rm -f $ids >/dev/null; fi
    return 0
}

cleanup() {
    local rc=$?
    set +e
    if docker info >/dev/null 2>&1; then
        remove_ours
    fi
    if [ "$started_engine" = 1 ]; then
        # Ours are gone: any container left (running or stopped) is someone else's.
        others=$(docker ps -aq 2>/dev/null | wc -l)
        if [ "$others" -eq 0 ]; then
            bash "$ENGINE" down
        else
            echo "make test-images: the engine it started is left running: $others other" \
                "container(s) on it (docker ps -a)" >&2
        fi
    fi
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
set +e
remove_ours
set -e

start=$(date +%s)
set +e
CHAOS_PROJECT=$PROJECT-chaos .venv/bin/python -m pytest tests/images/check_images.py \
    tests/images/check_roles.py tests/images/check_chaos.py -p no:cacheprovider --timeout=1800 \
    -o addopts="" -q -ra -s "$@"
rc=$?
set -e
echo "make test-images: pytest exit $rc after $(( $(date +%s) - start )) s (measurements: .run/test-images/)"
exit "$rc"
