"""Learning from preferences without sampling: ``DPOTrainer`` (dpo), ``KTOTrainer`` (kto, kto_config) and the
reward model's ``RewardTrainer`` (reward), each with its config."""
