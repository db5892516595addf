# --- pipeline targets (merge into Makefile; `run` replaces the current one) ------------------------
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
