"""``rlhf_core.commands``: TRL 0.11's ``trl.commands`` path (its ``cli_utils`` module is what scripts import)."""
