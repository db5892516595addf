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

.PHONY: setup test test-slow examples bench trl-tests lock clean

setup: $(STAMP)

# torch first, pinned: an unpinned or transitive torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

examples: setup
	$(PY) examples/minimal_example.py
	$(PY) examples/readme_example.py
	$(PY) examples/training_loop.py
	$(PY) examples/ppo_programmatic_reward.py

# One thread per test process: the tiny test models gain nothing from more, and it keeps runs steady.
# `make test` is the whole suite but the `slow` end-to-end checks (pipeline e2e, retraining, SIGTERM through
# dvc repro, soak, DDPO learning: about 3 more minutes), which `make test-slow` runs; CI runs both.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m "not slow"

test-slow: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m slow

# Classic TRL 0.11.4's own unit tests against rlhf_core (TRL=path to a trl v0.11.4 checkout; TRL_TESTS_FLAGS=--trl
# runs them against trl itself). See bench/trl_tests/README.md.
trl-tests: setup
	bash bench/trl_tests/run.sh $(TRL_TESTS_FLAGS) $(or $(TRL),$(error set TRL=path/to/trl-v0.11.4 checkout))

# Side by side with classic TRL 0.11.4 (its own cached venv in bench/.trl-venv); writes bench/results.{md,json}.
bench: setup
	bash bench/setup_trl_venv.sh
	OMP_NUM_THREADS=1 $(PY) bench/run.py

# Regenerate the lock file from the current environment (after changing pyproject.toml).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v '^rlhf' > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache

# One thread per process: on a shared 2-core machine two threads per process made PPO ~10x slower.
.PHONY: run pipeline repro mlflow-ui prefect-ui retrain serve-retrain

run: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.pipeline
	@echo ""
	@echo "Where to look:"
	@echo "  MLflow UI:  make mlflow-ui   -> http://127.0.0.1:5000 (experiment rlhf-pipeline, registered model rlhf-policy)"
	@echo "  DVC:        $(VENV)/bin/dvc metrics show   |   $(VENV)/bin/dvc status   |   plots/*.csv"
	@echo "  Prefect UI: make prefect-ui  -> http://127.0.0.1:4200 (flow runs, logs, artifacts)"

pipeline: run

# The same stages through DVC, then the registry step (the flow finds nothing stale).
repro: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/dvc repro
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.pipeline

mlflow-ui: setup
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

prefect-ui: setup
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

retrain: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.retrain

# Needs `make prefect-ui` running in another terminal.
serve-retrain: setup
	PREFECT_API_URL=http://127.0.0.1:4200/api OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.retrain --serve

# Send what stages kept in tracking-spool/ while the MLflow server was unreachable (to $MLFLOW_TRACKING_URI,
# else the project's store). Uploaded spools are renamed *.uploaded, so running it twice sends nothing twice.
.PHONY: tracking-upload
tracking-upload: setup
	$(PY) -m rlhf_core.tracking upload tracking-spool --tracking-uri "$${MLFLOW_TRACKING_URI:-sqlite:///$(CURDIR)/mlflow.db}"
