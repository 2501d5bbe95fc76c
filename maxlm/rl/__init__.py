"""Reinforcement learning with verifiable rewards: the rewards that score a completion (rewards.py). GRPO's
update is the objective maxlm.objectives.grpo."""
