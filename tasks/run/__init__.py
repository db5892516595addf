"""Supervision: the wrapper that runs one row of the stage table, PipelineRun (lock, stop handlers, orphans, how a
run ends), the retraining worktree, cleaning up after killed runs. The top floor of tasks/."""
