"""Docker HEALTHCHECK: exit 0 when GET /healthz answers 200 (the image has no curl)."""

import os
import sys
import urllib.request

url = f"http://127.0.0.1:{os.environ.get('HTTP_PORT', '9998')}/healthz"
try:
    with urllib.request.urlopen(url, timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as exc:
    print(f"unhealthy: {exc}", file=sys.stderr)
    sys.exit(1)
