"""Background work on the serving model's base: local LoRA training and holdout evaluation."""
