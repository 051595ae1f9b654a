"""FLUX.1 and FLUX.2-klein: the adapters (`adapter.py`, `klein.py`), their tiny test models (`tiny.py`)
and FLUX.1's full-size public configs for random-init measurements (`config.py`). README.md says what the
family supports."""
