"""The Qwen3-Omni thinker family; its README.md says what it trains and where its parts are."""
