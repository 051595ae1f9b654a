"""The Wan2.1 / Wan2.2 family; its README.md says what it trains and where its parts are."""
