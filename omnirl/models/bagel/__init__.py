"""The BAGEL family; its README.md says what it trains and where its parts are."""
