"""The LTX-2 family; its README.md says what it trains and where its parts are."""
