"""Evaluation of a trained LoRA against its base model with separate eval rewards."""
