"""Checkpoint formats other than maxlm's own: Hugging Face config.json + safetensors, in and out."""
