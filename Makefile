# Two commands do all the set-up on a fresh machine:
#   make demo   installs into .venv, then tunes the built-in tiny model (CPU if there is no GPU)
#   make test   installs into .venv, then runs the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install browser postgres clean wheelhouse wheelhouse-deepspeed wheelhouse-qlora gpu-check

# The tests and the demo start hundreds of interpreters: where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines) none would write bytecode, and each would compile torch and transformers again.
unexport PYTHONDONTWRITEBYTECODE

install: $(STAMP)

# Without an NVIDIA driver, install the CPU build of torch first, so the range in pyproject.toml
# is already satisfied and pip never downloads the multi-GB CUDA wheels. pip installs without
# byte-compiling (one file at a time, 125 s on 2 cores; compileall on every core took 58 s for
# site-packages' 16,700 files, most of them never imported): each interpreter that runs from here
# writes the bytecode of what it imports first, and the next ones read it (the unexport above).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no NVIDIA driver: installing the CPU build torch==2.13.0 first"; \
		$(PY) -m pip install -q --no-compile torch==2.13.0; \
	fi
	$(PY) -m pip install -q --no-compile -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/autotune run --space quick --seq-len 128 --budget 3m --output best.json

# The tests run in up to four processes (pytest-xdist), one per core: most of their time is spent starting
# interpreters and probes, not computing. Work stealing keeps the slowest tests from ending on one worker.
test: $(STAMP) browser postgres lint
	$(PY) -m pytest -n auto --maxprocesses 4 --dist worksteal

# ruff over the code, the tests and the benchmarks; mypy over the search package (its imports are
# read for their types, their own errors not reported; torch, transformers and the rest of the training
# stack are read as Any: pyproject.toml's [tool.mypy]).
lint: $(STAMP)
	$(VENV)/bin/ruff check autotune tests bench
	$(VENV)/bin/mypy --follow-imports=silent autotune/search

# The report's browser test drives Debian's Chromium; CI runs as root on Debian, so install it there
# when it is missing (elsewhere the test skips without it, and fails under CI=true).
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing chromium and chromium-driver for the report's browser test"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
		else \
			echo "chromium/chromedriver missing and not root: the browser test will skip (or fail under CI=true)"; \
		fi; \
	fi

# The storage tests run studies through a throwaway PostgreSQL server (tests/conftest.py: postgres_url,
# started as the postgres user on 127.0.0.1). CI runs as root on Debian, so install Debian's postgresql there
# when it is missing (elsewhere those tests skip without it, and fail under CI=true).
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing postgresql for the storage tests"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
		else \
			echo "postgresql missing and not root: the PostgreSQL storage tests will skip (or fail under CI=true)"; \
		fi; \
	fi

# The wheels a CUDA image with only torch and transformers lacks (optuna, plotly, rich, pandas,
# accelerate, nvidia-ml-py, pytest and their dependencies), for CPython $(WHEEL_PYTHON) x86_64, into the
# ignored wheelhouse/: run it where PyPI is reachable, then `make gpu-check` works without network.
WHEEL_PYTHON ?= 3.12
wheelhouse: $(STAMP)
	$(PY) -m bench.wheelhouse --dest wheelhouse --python-version $(WHEEL_PYTHON)

# The same, plus DeepSpeed (its wheel built here: PyPI has only its source) and its dependencies, for the
# sharding values (ZeRO stages and offload): `pip install --no-index --find-links wheelhouse deepspeed` there.
wheelhouse-deepspeed: $(STAMP)
	$(PY) -m bench.wheelhouse --dest wheelhouse --python-version $(WHEEL_PYTHON) --deepspeed

# The same, plus bitsandbytes unpacked into wheelhouse/bnb_site (only its CPU and CUDA 13 libraries,
# 8 MiB) for --peft qlora and the 8-bit optimizers: bench/gpu_peft_studies.sh puts it on PYTHONPATH.
wheelhouse-qlora: $(STAMP)
	$(PY) -m bench.wheelhouse --dest wheelhouse --python-version $(WHEEL_PYTHON) --bitsandbytes

# The GPU acceptance run (bench/gpu_acceptance.py): every GPU check on the first visible GPU, at most
# 25 minutes, into reports/gpu/<device>-<date>/. It uses the interpreter it finds (a GPU image's
# python, with torch and transformers), installing what is missing from wheelhouse/.
# GPU_ARGS passes options through, e.g. GPU_ARGS="--phase landscape --out reports/gpu/DIR".
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PYTHON) -m bench.gpu_acceptance $(GPU_ARGS)

clean:
	rm -rf $(VENV) autotune.db best.json test-artifacts
