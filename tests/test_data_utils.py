"""``rlhf_core.data_utils`` (TRL's ``trl.data_utils``): conversational rows rendered, implicit prompts extracted,
paired preferences unpaired for KTO."""

from __future__ import annotations

import pytest
from datasets import Dataset, DatasetDict

from rlhf_core import (apply_chat_template, extract_prompt, is_conversational, maybe_apply_chat_template,
                       maybe_extract_prompt, maybe_unpair_preference_dataset, unpair_preference_dataset)
from rlhf_core.models.chat_format import SIMPLE_CHAT_TEMPLATE

USER = {"role": "user", "content": "What color is the sky?"}
BLUE, GREEN = {"role": "assistant", "content": "It is blue."}, {"role": "assistant", "content": "It is green."}


@pytest.fixture
def chat_tokenizer(tokenizer):
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE  # "Role: content\n\n" turns, "Assistant:" to generate
    return tokenizer


def test_is_conversational():
    assert is_conversational({"prompt": [USER], "completion": [BLUE]})
    assert is_conversational({"messages": [USER, BLUE]})
    assert not is_conversational({"prompt": "What color?", "completion": " Blue."})
    assert not is_conversational({"label": True})


def test_apply_chat_template_cuts_completions_after_the_prompt(chat_tokenizer):
    row = apply_chat_template({"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN], "label": 1}, chat_tokenizer)
    # the template renders "Assistant: It is blue.\n\n" after the user turn; the prompt ends with "Assistant:"
    assert row == {"prompt": "User: What color is the sky?\n\nAssistant:", "chosen": " It is blue.\n\n",
                   "rejected": " It is green.\n\n", "label": 1}
    assert apply_chat_template({"messages": [USER, BLUE]}, chat_tokenizer) == {
        "text": "User: What color is the sky?\n\nAssistant: It is blue.\n\n"}
    standard = {"prompt": "a", "completion": "b"}
    assert maybe_apply_chat_template(standard, chat_tokenizer) is standard


def test_extract_prompt():
    row = extract_prompt({"chosen": [USER, BLUE], "rejected": [USER, GREEN]})
    assert (row["prompt"], row["chosen"], row["rejected"]) == ([USER], [BLUE], [GREEN])
    text = extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."})
    assert (text["prompt"], text["chosen"], text["rejected"]) == ("The sky is", " blue.", " green.")
    explicit = {"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]}
    assert maybe_extract_prompt(explicit) is explicit
    # a string prompt beside conversational pairs that repeat it: the prompt is taken from the pairs
    assert maybe_extract_prompt({"prompt": "What color is the sky?", "chosen": [USER, BLUE],
                                 "rejected": [USER, GREEN]})["prompt"] == [USER]


def test_unpair_preference_dataset():
    paired = Dataset.from_dict({"prompt": ["p1", "p2"], "chosen": ["c1", "c2"], "rejected": ["r1", "r2"]})
    unpaired = unpair_preference_dataset(paired)
    assert unpaired["prompt"] == ["p1", "p2", "p1", "p2"] and unpaired["completion"] == ["c1", "c2", "r1", "r2"]
    assert unpaired["label"] == [True, True, False, False]
    both = maybe_unpair_preference_dataset(DatasetDict({"train": paired, "test": paired}))
    assert set(both) == {"train", "test"} and both["test"].num_rows == 4
    assert maybe_unpair_preference_dataset(unpaired) is unpaired
    with pytest.raises(ValueError, match="lacks the columns"):
        unpair_preference_dataset(unpaired)
