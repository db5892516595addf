"""Classic TRL's PPO: ``PPOTrainer`` (trainer), ``PPOConfig`` (config), input checks (validation), exact resume
(state), the run loop (loop), the step's stats (stats), construction helpers (setup) and Hub pushes (hub)."""
