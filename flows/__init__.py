"""Prefect flows and the pipeline's command lines: pipeline.py (every stage), stage.py (one: what dvc.yaml runs),
retrain.py, intake.py, serve.py (team mode), tracking.py (spool upload), report.py, ui.py.

Nothing happens on import: each entry point configures its process itself (``flows/process.py``).
"""
