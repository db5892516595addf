"""The process a stage runs in: launcher ranks and collectives, logging, the one-run-per-checkout lock, the
Prefect context, and how a run that raised ends (outcome.py: `classify`). Imports only spec/."""
