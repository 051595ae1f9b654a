"""FLUX.2-klein; its README.md says what it trains and where its parts are."""
