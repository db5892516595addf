"""The process a stage runs in: launcher ranks and collectives, logging, the one-run-per-checkout lock, the
Prefect context. Imports nothing else of tasks/."""
