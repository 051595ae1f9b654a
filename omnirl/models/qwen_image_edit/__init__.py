"""The Qwen-Image-Edit family; its README.md says what it trains and where its parts are."""
