"""Qwen2.5-VL and Qwen3-VL have no full-size config-only checkpoint yet: `RANDOM` names none. A
checkpoint's config.json alone is enough for `model.weights random` (omnirl.models.random_init)."""

RANDOM: dict = {}
