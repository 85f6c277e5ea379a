#!/bin/sh
# Entry point of docker/Dockerfile.serving (under tini): the Paddle Serving OCR pipeline.
# serving_config/web_service.py reads ./config.yml and writes ./PipelineServingLogs, so it runs
# in a writable run directory (an emptyDir in Kubernetes) with a copy of
# serving_config/config.yml whose ports and devices come from the environment.
set -eu

PDSERVING=${PDSERVING_DIR:-/opt/PaddleOCR/deploy/pdserving}
RUN_DIR=${SERVING_RUN_DIR:-/opt/PaddleOCR/deploy/run}

mkdir -p "$RUN_DIR" "${HOME:?HOME must be set}"
sed -e "s/^rpc_port:.*/rpc_port: ${SERVING_RPC_PORT:-18091}/" \
    -e "s/^http_port:.*/http_port: ${SERVING_HTTP_PORT:-9998}/" \
    -e "s/^\( *devices:\).*/\1 \"${SERVING_DEVICES-0}\"/" \
    "$PDSERVING/config.yml" > "$RUN_DIR/config.yml"

cd "$RUN_DIR"
exec "${SERVING_PYTHON:-python3}" "$PDSERVING/web_service.py"
