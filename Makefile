# Two commands for a fresh machine: `make run` and `make test`. Both set up .venv first.
.DEFAULT_GOAL := help
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
# This project's own Prefect home (its database: the runs `make prefect-ui` shows), as flows/process.py's
# prefect_settings gives every entry point; the user's Prefect profiles still apply. A PREFECT_HOME set outside wins.
ifndef PREFECT_HOME
export PREFECT_HOME := $(CURDIR)/.prefect
export PREFECT_PROFILES_PATH := $(HOME)/.prefect/profiles.toml
endif

.PHONY: help setup test test-slow examples bench trl-tests trl-examples lock clean plots exps metrics

help: ## list the targets, one line each
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-zA-Z_-]+):.*## (.*)$$/\1\t\2/' | awk -F'\t' '{printf "  %-16s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv and install the pinned dependencies (CPU torch)

# torch first, pinned: an unpinned or transitive torch would pull a multi-GB CUDA build.
# Then: `.venv/bin/<tool>` finds the venv's other tools as if activated (tools/venv_path.py), and the offline
# template `dvc plots show` uses is written (tools/offline_plots.py; .dvc/config names it).
UV_VERSION := 0.13.9
$(STAMP): pyproject.toml requirements.lock tools/venv_path.py tools/offline_plots.py tools/install_lock.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup 1/3: torch 2.13.0, CPU build (~200 MB; pip lists each package as it goes), and uv if the index has it"
	$(PY) -m pip install --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check uv==$(UV_VERSION) || echo "no uv: pip installs the lock"
	@echo "setup 2/3: the pinned dependencies (requirements.lock: uv with pip's index settings, else pip)"
	$(PY) tools/install_lock.py requirements.lock
	@echo "setup 3/3: this project (editable)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	$(PY) tools/venv_path.py >/dev/null
	$(PY) tools/offline_plots.py template >/dev/null
	touch $(STAMP)

examples: setup ## run the classic-TRL example scripts against rlhf_core
	$(PY) examples/minimal_example.py
	$(PY) examples/readme_example.py
	$(PY) examples/training_loop.py
	$(PY) examples/ppo_programmatic_reward.py

# One thread per test process: the tiny test models gain nothing from more, and it keeps runs steady.
# `make test` is the whole suite but the `slow` end-to-end checks (pipeline e2e, retraining, SIGTERM through
# dvc repro, soak, DDPO learning: about 3 more minutes), which `make test-slow` runs; CI runs both.
test: setup ## set up, then run the fast test suite (no slow end-to-end checks)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m "not slow"

test-slow: setup ## run the slow end-to-end checks (pipeline, retraining, signals, soak)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m slow

# Classic TRL 0.11.4's own unit tests against trl 0.11.4 with its release-era libraries, with today's, and against
# rlhf_core, then rlhf_core compared test by test with each baseline (TRL=path to a trl v0.11.4 checkout;
# TRL_TESTS_FLAGS=--trl-era, --trl or an empty value runs one of them). See bench/trl_tests/README.md.
TRL_TESTS_FLAGS ?= --all
trl-tests: setup ## classic TRL 0.11.4's own tests: trl 0.11.4 (2024 and today's libraries) and rlhf_core, compared (TRL=<checkout>)
	bash bench/trl_tests/run.sh $(TRL_TESTS_FLAGS) $(or $(TRL),$(error set TRL=path/to/trl-v0.11.4 checkout))

# TRL's own clients (v0.11.4's example scripts, notebooks and docs snippets; TRL 1.16's trl/scripts) run as published,
# beside real TRL (each in its own venv) and against rlhf_core with only their `trl` import lines changed, on tiny
# local fixtures; prints and writes the table docs/trl_clients.md (TRL=path to a trl v0.11.4 checkout). Long: not in
# `make test`. See bench/trl_examples/README.md.
trl-examples: setup ## TRL's example scripts/notebooks/docs snippets: real TRL vs rlhf_core, table in docs/trl_clients.md (TRL=<checkout>)
	bash bench/setup_trl_era_venv.sh
	bash bench/setup_trl116_venv.sh
	$(PY) bench/trl_examples/run.py --trl $(or $(TRL),$(error set TRL=path/to/trl-v0.11.4 checkout)) --out docs/trl_clients.md

# Side by side with classic TRL 0.11.4 (its own cached venv in bench/.trl-venv); writes bench/results.{md,json}.
bench: setup ## benchmark against classic TRL 0.11.4 (PPO) and TRL 1.16.0 (GRPO, RLOO), each in its own venv; writes bench/results.{md,json}
	bash bench/setup_trl_venv.sh
	bash bench/setup_trl116_venv.sh
	OMP_NUM_THREADS=1 $(PY) bench/run.py

# The GPU bench travels to a network-less GPU machine as the working tree plus this git-ignored folder (wheels the
# machine lacks, the rt-polarity corpus); there, `bash bench/gpu/run.sh` runs it. See docs/bench.md.
.PHONY: bench-gpu-bundle
bench-gpu-bundle: setup ## build bench/gpu/bundle/ (wheels + data) for `bash bench/gpu/run.sh` on a GPU machine with no network
	$(PY) bench/gpu/bundle.py

# Regenerate the lock file from the current environment (after changing pyproject.toml).
lock: ## regenerate requirements.lock from the current venv
	$(PY) -m pip freeze --exclude-editable | grep -v '^rlhf' > requirements.lock

clean: ## remove .venv and pytest caches
	rm -rf $(VENV) .pytest_cache

# One thread per process: on a shared 2-core machine two threads per process made PPO ~10x slower.
.PHONY: run pipeline repro mlflow-ui prefect-ui retrain land-retrain serve-retrain

# POLICY_WORKERS=N runs up to N policy stages side by side, each in its own process (its own GPU(s) when several
# are visible); auto (the default): one per GPU, else two per core (each stage runs one thread: OMP_NUM_THREADS=1);
# 1: one after another in the pipeline's process. Hardware, not a param: the outputs are the same bytes either way.
POLICY_WORKERS ?= $(or $(RLHF_POLICY_WORKERS),auto)
# TASK=sentiment (the default): the pipeline at the repository root. TASK=<name>: the one in pipelines/<name>/ (its
# own params.yaml, dvc.yaml, dvc.lock, data/, models/, metrics/, plots/; the same MLflow store), e.g. TASK=arithmetic.
TASK ?= sentiment
TASK_ROOT := $(if $(filter sentiment,$(TASK)),.,pipelines/$(TASK))
TASK_ARGS := $(if $(filter sentiment,$(TASK)),,--root $(TASK_ROOT))
.PHONY: task-check
task-check:
	@test -f $(TASK_ROOT)/params.yaml || { echo "TASK=$(TASK): no $(TASK_ROOT)/params.yaml (tasks: sentiment $$(ls pipelines 2>/dev/null | tr '\n' ' '))" >&2; exit 2; }

run: setup remote task-check ## set up, then run the whole pipeline (TASK=sentiment, the default, or TASK=arithmetic: prepare -> sft -> rm -> policies -> evaluate -> registry) and push to the DVC remote
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.pipeline $(TASK_ARGS) $(if $(POLICY_WORKERS),--policy-workers $(POLICY_WORKERS))
	@$(PY) -m flows.report readme $(TASK_ARGS) >/dev/null  # quiet (errors still show): the pipeline's end block stays last
	@$(DVC) push -q

pipeline: run ## same as run

# The same stages through DVC, then the registry step (the flow finds nothing stale). `python -m tasks.store.dvc_lockfile`
# is dvc with its dvc.lock writes made atomic (a kill never tears the lock) and a torn lock repaired first.
repro: setup task-check ## run the stages through dvc repro, then the registry step (TASK=... as for run)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m tasks.store.dvc_lockfile repro $(if $(TASK_ARGS),$(TASK_ROOT)/dvc.yaml)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.pipeline $(TASK_ARGS)

# Prints where to open it (the training runs' view, the policies side by side), then runs `mlflow ui` (same PID).
MLFLOW_PORT ?= 5000
PREFECT_PORT ?= 4200
mlflow-ui: setup ## MLflow UI on http://127.0.0.1:5000, opened on the training runs (runs, charts, comparison, registry)
	$(PY) -m flows.ui --port $(MLFLOW_PORT)

prefect-ui: setup ## Prefect server and UI on http://127.0.0.1:4200 (this project's runs: its .prefect/)
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

retrain: setup ## retrain from the committed state (stale stages only, evaluate, register), then land the record on the branch
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.retrain

# A retrain whose branch moved meanwhile leaves its record on retrain/<stamp>: this merges it and restores outputs.
land-retrain: setup ## land a retraining record on the checked-out branch: make land-retrain REF=retrain/<stamp>
	@test -n "$(REF)" || { echo "usage: make land-retrain REF=retrain/<stamp>  (git branch --list 'retrain/*')" >&2; exit 2; }
	$(PY) -m flows.retrain --land $(REF)

# Needs `make prefect-ui` running in another terminal.
serve-retrain: setup ## serve the retraining flow on its cron schedule (needs make prefect-ui)
	PREFECT_API_URL=http://127.0.0.1:4200/api OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.retrain --serve

# Send what stages kept in tracking-spool/ while the MLflow server was unreachable (to $MLFLOW_TRACKING_URI,
# else the project's store). Uploaded spools are renamed *.uploaded, so running it twice sends nothing twice.
.PHONY: tracking-upload
tracking-upload: setup ## replay tracking data spooled while MLflow was unreachable
	$(PY) -m flows.tracking upload tracking-spool --tracking-uri "$${MLFLOW_TRACKING_URI:-sqlite:///$(CURDIR)/mlflow.db}"

# DVC's plot page loads vega from a CDN (blank offline): `make setup` writes .venv/vega/dvc-template.html with the
# scripts inlined (tools/offline_plots.py), which .dvc/config names, so `.venv/bin/dvc plots show` works offline.
plots: setup ## render every DVC plot to dvc_plots/index.html, offline (vega inlined)
	$(VENV)/bin/dvc plots show -o dvc_plots

# `dvc metrics show` is one row per file, one column per key of every file (1,449 columns here): this is 120 columns.
metrics: setup task-check ## every stage's metrics in 120 columns (the evaluation as a policies x metrics table; TASK=... as for run)
	@$(PY) -m flows.report metrics $(TASK_ARGS)

# `dvc exp show` with only the headline columns, so it fits a terminal.
# One evaluate.json key per policy in a table under 100 columns; dvc exp show --md lists every column.
METRIC ?= gold_reward
exps: setup ## experiments, one column per policy: gold reward (METRIC=kl|win_rate|... for another)
	@$(VENV)/bin/dvc exp show --drop '.*' --keep '(Experiment|rev|typ|Created|.*\.$(METRIC))$$' --csv \
	  | $(PY) tools/exps_table.py $(METRIC)

# The DVC remote (docs/lifecycle.md). Default: ~/.cache/rlhf-pipeline/dvc-remote, named in .dvc/config.
# `make remote DVC_REMOTE=/shared/store` (or s3://..., gs://..., azure://..., ssh://...) writes the URL to the
# git-ignored .dvc/config.local, per user; so does a set XDG_CACHE_HOME ($XDG_CACHE_HOME/rlhf-pipeline/dvc-remote)
# unless .dvc/config.local already names a URL. DVC itself expands `~` but not environment variables.
DVC := $(VENV)/bin/dvc
.PHONY: remote push pull intake
remote: setup ## show the DVC remote; DVC_REMOTE=<path or URL> sets it for you (.dvc/config.local)
	@if [ -n "$(DVC_REMOTE)" ]; then $(DVC) remote modify --local shared url "$(DVC_REMOTE)"; \
	elif [ -n "$$XDG_CACHE_HOME" ] && ! $(DVC) config --local remote.shared.url >/dev/null 2>&1; then \
	  $(DVC) remote modify --local shared url "$$XDG_CACHE_HOME/rlhf-pipeline/dvc-remote"; fi
	@echo "DVC remote: $$($(DVC) config remote.shared.url)"

# Data, models and feedback batches to the remote: a teammate's `git clone` + `make pull` restores them.
push: setup ## dvc push: data, models and feedback batches to the remote
	$(DVC) push

# dvc pull, and when a recorded hash is in neither the cache nor the remote: which output, why, what to run.
pull: setup ## dvc pull: this commit's data, models and feedback batches from the remote (a missing one: why, what to run)
	$(PY) -m tasks.store.dvc_pull

# Versioned feedback: `make intake FILE="new_pairs.jsonl more.csv"` (see incoming/README.md).
intake: setup remote ## validate, version and push new feedback: make intake FILE=pairs.jsonl
	@test -n "$(FILE)" || { echo "usage: make intake FILE=path/to/feedback.jsonl [FILE=...]" >&2; exit 2; }
	$(PY) -m flows.intake $(FILE)

# Human feedback in the loop (docs/lifecycle.md): the champion served with a trace per answer, a review page that
# records judgements as MLflow assessments, and their intake as versioned feedback (then a retrain, as `make intake`).
.PHONY: serve-model review intake-feedback
serve-model: setup ## serve the champion on http://127.0.0.1:5001 (follows the alias; a trace per answer; MODEL_PORT=...)
	$(PY) -m flows.serve_model

review: setup ## the review page on http://127.0.0.1:5002: rate answers, choose the better of two (REVIEW_PORT=...)
	$(PY) -m flows.review

intake-feedback: setup remote ## ingest the judgements made since the last intake as feedback batches, then retrain
	$(PY) -m flows.collect_feedback

# Team mode on 127.0.0.1: Prefect server + process work pool + worker, MLflow server, prefect.yaml deployed.
# PIDs and logs in .serve/; `make serve-stop` stops exactly those PIDs.
.PHONY: serve serve-stop
serve: setup remote ## team mode on 127.0.0.1: Prefect server + worker, MLflow server, deployments
	$(PY) -m flows.serve start

serve-stop: ## stop what make serve started (by PID)
	$(PY) -m flows.serve stop
