"""What a run is asked to do: params.yaml's schema and value rules, output paths, a stage's row (Stage, StageIO,
StageContext, StageResult). Imports nothing else of tasks/."""
