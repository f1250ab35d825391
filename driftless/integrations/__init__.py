"""driftless inside the frameworks users already run: ``driftless.integrations.trl`` (TRL's GRPO trainer)."""
