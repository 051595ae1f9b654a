"""The Qwen-Image family; its README.md says what it trains and where its parts are."""
