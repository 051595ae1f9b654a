"""scripts/make_tiny_models.py: the library warnings a build prints that do not apply are left out, and
only those."""

import importlib.util
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def known_warnings() -> logging.Filter:
    spec = importlib.util.spec_from_file_location("make_tiny_models", ROOT / "scripts/make_tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KnownWarnings()


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("transformers.x", logging.WARNING, __file__, 1, message, None, None)


def test_known_build_warnings_are_left_out_and_no_others():
    f = known_warnings()
    rope = "Unrecognized keys in `rope_parameters` for 'rope_type'='default': "
    dropped = [
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` "
        "for backward compatibility.",
        rope + "{'mrope_section', 'mrope_interleaved'}",
        rope + "{'mrope_interleaved', 'mrope_section'}",
        "self.processor=None of type <class 'NoneType'> cannot be saved.",
    ]
    kept = [
        rope + "{'mrope_section', 'factor'}",
        "self.vae=None of type <class 'NoneType'> cannot be saved.",
        "Some weights of the model checkpoint were not used when initializing",
    ]
    assert [f.filter(record(m)) for m in dropped] == [False] * len(dropped)
    assert [f.filter(record(m)) for m in kept] == [True] * len(kept)
