"""The online methods of TRL 1.x: ``GRPOTrainer`` and ``RLOOTrainer`` with their configs, over the shared
``OnlineRLTrainer`` (trainer) and ``OnlineRLConfig`` (config)."""
