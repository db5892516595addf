"""Copied into the harness's working directory (the pytest rootdir) when running TRL's tests against rlhf_core.

TRL 0.11.4's test modules import a few names transformers 5 renamed; they are aliased here so the modules
import (the vision tests that use them still need the real models and are counted as they fall).
"""

import transformers

if not hasattr(transformers, "AutoModelForVision2Seq") and hasattr(transformers, "AutoModelForImageTextToText"):
    transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
