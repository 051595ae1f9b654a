"""FLUX.1: the adapter (`adapter.py`), its tiny test model (`tiny.py`) and its full-size public configs
for random-init measurements (`config.py`). README.md says what the family supports."""
