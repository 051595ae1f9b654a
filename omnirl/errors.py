"""The errors a user's input raises: a recipe or override (`ConfigError`) and a data file or row
(`DataError`). Each message is one line naming the field, file, row or key. The ground floor: every
layer may raise them, and this module imports nothing of omnirl."""


class ConfigError(ValueError):
    """A recipe or override that cannot become a valid config."""


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file and line (or the row)."""
