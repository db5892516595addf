"""Where results are recorded: atomic outputs, provenance, DVC (status, commit, dvc.lock) and MLflow (store,
parent run, a stage's child run). Imports spec/ and process/."""
