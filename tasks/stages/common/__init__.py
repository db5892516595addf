"""What several stage bodies share: loading and training a policy from SFT, grpo/rloo's body, sample
windows, scoring a policy, resumable Trainer training, prepare's source."""
