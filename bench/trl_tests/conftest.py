"""Copied into the harness's working directory (the pytest rootdir) when running TRL's tests against rlhf_core.

TRL 0.11.4's test modules import a few names transformers 5 renamed; they are aliased here so the modules
import (the vision tests that use them still need the real models and are counted as they fall).
"""

import importlib
import sys


def _alias_renamed_names() -> None:
    """``AutoModelForVision2Seq`` (transformers 4) is ``AutoModelForImageTextToText`` in transformers 5.

    The module is looked up in ``sys.modules`` each time: importing the trainers replaces the lazy
    ``transformers`` module object there, so an alias set on the old object would be lost.
    """
    transformers = sys.modules.get("transformers") or importlib.import_module("transformers")
    if "AutoModelForVision2Seq" not in vars(transformers) and hasattr(transformers, "AutoModelForImageTextToText"):
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText


_alias_renamed_names()


def pytest_collectstart(collector):
    """Again before each test module is imported (see above)."""
    _alias_renamed_names()
