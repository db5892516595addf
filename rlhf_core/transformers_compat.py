"""Return values of the transformers of TRL 0.11's era that classic PPO clients rely on, kept on today's.

TRL 0.11's PPO examples and notebooks score responses with ``sentiment_pipe(texts, return_all_scores=True,
function_to_apply="none")`` and read ``output[1]["score"]`` (every label's score, in label order). transformers 5
dropped ``return_all_scores`` without a word: the option reaches the tokenizer, which ignores it, and the pipeline
returns one dict per text, so the client's ``output[1]`` fails far from the cause. ``install()`` (run when
rlhf_core's PPO trainer is imported) makes the text-classification pipeline accept the option again, with a
FutureWarning naming today's spelling, and return what it used to: every label, in label order, per text. A call
without ``return_all_scores`` is untouched. docs/library.md lists this beside the changes that are refused by name.
"""

from __future__ import annotations

import functools
import warnings

_INSTALLED = "_rlhf_core_return_all_scores"


def install() -> None:
    """Make ``TextClassificationPipeline`` accept transformers 4's ``return_all_scores`` (idempotent)."""
    from transformers.pipelines.text_classification import TextClassificationPipeline

    sanitize = TextClassificationPipeline._sanitize_parameters
    if getattr(sanitize, _INSTALLED, False):
        return

    @functools.wraps(sanitize)
    def sanitize_with_return_all_scores(self, *args, **kwargs):
        if "return_all_scores" not in kwargs:
            return sanitize(self, *args, **kwargs)
        every_label = bool(kwargs.pop("return_all_scores"))
        warnings.warn("return_all_scores was removed from transformers' text-classification pipeline (transformers "
                      "5); rlhf_core maps it (every label, in label order). Today's spelling: top_k=None (sorted by "
                      "score, so read the label) or top_k=1", FutureWarning, stacklevel=4)
        preprocess, forward, postprocess = sanitize(self, *args, **kwargs)
        if every_label and "top_k" not in kwargs:
            # transformers' own legacy path with no cut: every label, unsorted (label order)
            postprocess.update(top_k=None, _legacy=True)
        return preprocess, forward, postprocess

    setattr(sanitize_with_return_all_scores, _INSTALLED, True)
    TextClassificationPipeline._sanitize_parameters = sanitize_with_return_all_scores
