"""``rlhf_core.extras``: TRL 0.11's ``trl.extras`` path (its ``dataset_formatting`` module is what scripts import)."""
