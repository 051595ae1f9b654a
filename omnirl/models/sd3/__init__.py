"""The Stable Diffusion 3 / 3.5 family; its README.md says what it trains and where its parts are."""
