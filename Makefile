# Two commands for a fresh machine: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: setup run test examples bench lock clean

setup: $(STAMP)

# torch first, pinned: an unpinned or transitive torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

run: setup examples

examples: setup
	$(PY) examples/minimal_example.py
	$(PY) examples/readme_example.py
	$(PY) examples/training_loop.py
	$(PY) examples/ppo_programmatic_reward.py

test: setup
	$(PY) -m pytest tests

# Regenerate the lock file from the current environment (after changing pyproject.toml).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v '^rlhf' > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache
