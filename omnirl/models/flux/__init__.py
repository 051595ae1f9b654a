"""FLUX.1; its README.md says what it trains and where its parts are."""
