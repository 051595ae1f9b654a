"""The Qwen2.5-VL / Qwen3-VL family; its README.md says what it trains and where its parts are."""
