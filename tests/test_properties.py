"""Bad input, generated: every malformed batch gets a clear ``ValueError`` naming the problem, never a crash
deep inside torch, and nothing changes (weights, optimizer state, step counter).

Covers ``PPOTrainer.step``, the trainers' collators and the data readers ``tasks/prepare`` uses.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core.data import DataFormatError, read_jsonl, read_text_records
from rlhf_core.feedback import validate_batch
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm
from rlhf_core.trainers.collators import (
    DataCollatorForCompletionOnlyLM,
    DPODataCollatorWithPadding,
    RewardDataCollatorWithPadding,
)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                    derandomize=True)
TOKENIZER = build_tokenizer()


@pytest.fixture(scope="module")
def trainer():
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(TOKENIZER, seed=0))
    return PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1, ppo_epochs=1), model, None, TOKENIZER)


def _max_positions(trainer) -> int:
    config = trainer.accelerator.unwrap_model(trainer.model).pretrained_model.config
    return getattr(config, "n_positions", None) or config.max_position_embeddings


# ---------------------------------------------------------------------------------------------- PPO step

CORRUPTIONS = [
    "too_few", "too_many", "float_query", "bool_response", "2d_query", "empty_response", "negative_id", "id_too_big",
    "nan_score", "inf_score", "vector_score", "string_score", "list_query", "mask_shape", "too_long", "none_scores",
]


def _valid_batch(draw):
    ids = st.integers(3, 300)
    queries = [torch.tensor(draw(st.lists(ids, min_size=1, max_size=6))) for _ in range(2)]
    responses = [torch.tensor(draw(st.lists(ids, min_size=1, max_size=6))) for _ in range(2)]
    scores = [torch.tensor(draw(st.floats(-5, 5))) for _ in range(2)]
    return queries, responses, scores


@st.composite
def malformed_step(draw, max_positions: int):
    queries, responses, scores = _valid_batch(draw)
    kind = draw(st.sampled_from(CORRUPTIONS))
    i = draw(st.integers(0, 1))
    masks = None
    expect = kind
    if kind == "too_few":
        queries, expect = queries[:1], "does not match"
    elif kind == "too_many":
        scores, expect = scores + [torch.tensor(0.0)], "does not match"
    elif kind == "float_query":
        queries[i], expect = queries[i].float(), "integer token ids"
    elif kind == "bool_response":
        responses[i], expect = responses[i] > 100, "integer token ids"
    elif kind == "2d_query":
        queries[i], expect = queries[i].unsqueeze(0), "1-d"
    elif kind == "empty_response":
        responses[i], expect = torch.tensor([], dtype=torch.long), "empty"
    elif kind == "negative_id":
        queries[i][0], expect = -draw(st.integers(1, 10**6)), "outside"
    elif kind == "id_too_big":
        responses[i][-1], expect = draw(st.integers(len(TOKENIZER), 10**9)), "outside"
    elif kind == "nan_score":
        scores[i], expect = torch.tensor(float("nan")), "not finite"
    elif kind == "inf_score":
        scores[i], expect = torch.tensor(draw(st.sampled_from([float("inf"), float("-inf")]))), "not finite"
    elif kind == "vector_score":
        scores[i], expect = torch.ones(draw(st.integers(2, 4))), "scalar"
    elif kind == "string_score":
        scores[i], expect = "0.5", "scores"
    elif kind == "list_query":
        queries[i], expect = queries[i].tolist(), "torch.Tensor"
    elif kind == "mask_shape":
        masks = [torch.ones_like(r) for r in responses]
        masks[i], expect = torch.ones(len(responses[i]) + 1, dtype=torch.long), "response_masks"
    elif kind == "too_long":
        extra = draw(st.integers(1, 50))
        responses[i], expect = torch.randint(3, 300, (max_positions + extra,)), "longer than"
    elif kind == "none_scores":
        scores, expect = None, "scores"
    return queries, responses, scores, masks, expect


def test_malformed_step_inputs_raise_a_clear_error_and_change_nothing(trainer):
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    step_before = trainer.current_step

    @SETTINGS
    @given(malformed_step(_max_positions(trainer)))
    def check(case):
        queries, responses, scores, masks, expect = case
        with pytest.raises(ValueError, match=expect):
            trainer.step(queries, responses, scores, response_masks=masks)

    check()
    assert trainer.current_step == step_before
    assert not trainer.optimizer.state_dict()["state"]  # never stepped
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------- collators

junk = st.one_of(st.none(), st.text(max_size=3), st.floats(allow_nan=True), st.lists(st.text(max_size=2), max_size=3),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.just([[1, 2]]))
id_rows = st.lists(st.integers(0, 300), min_size=1, max_size=8)


@st.composite
def broken_reward_features(draw):
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        chosen, rejected = draw(id_rows), draw(id_rows)
        rows.append({"input_ids_chosen": chosen, "attention_mask_chosen": [1] * len(chosen),
                     "input_ids_rejected": rejected, "attention_mask_rejected": [1] * len(rejected)})
    kind = draw(st.sampled_from(["missing", "junk", "mask_length", "margin", "empty", "negative", "mask_values"]))
    row = draw(st.sampled_from(rows))
    key = draw(st.sampled_from(sorted(rows[0])))
    if kind == "missing":
        del row[key]
    elif kind == "junk":
        row[key] = draw(junk)
    elif kind == "mask_length":
        row[key.replace("input_ids", "attention_mask")] = [1] * (len(row[key.replace("attention_mask", "input_ids")]) + 1)
    elif kind == "margin":
        for r in rows:
            r["margin"] = 0.0
        row["margin"] = draw(st.sampled_from([float("nan"), float("inf"), "big", None]))
    elif kind == "empty":
        return []
    elif kind == "negative":
        row[key.replace("attention_mask", "input_ids")] = [-5] + row[key.replace("attention_mask", "input_ids")]
        row[key.replace("input_ids", "attention_mask")] = [1] * len(row[key.replace("attention_mask", "input_ids")])
    elif kind == "mask_values":
        mask_key = key.replace("input_ids", "attention_mask")
        row[mask_key] = [7] * len(row[mask_key])
    return rows


@SETTINGS
@given(broken_reward_features())
def test_reward_collator_rejects_malformed_features(features):
    with pytest.raises(ValueError, match="reward|feature|column|input_ids|attention_mask|margin|empty"):
        RewardDataCollatorWithPadding(TOKENIZER)(features)


@st.composite
def broken_dpo_features(draw):
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        prompt, chosen, rejected = draw(id_rows), draw(id_rows), draw(id_rows)
        rows.append({"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt),
                     "chosen_input_ids": prompt + chosen, "chosen_attention_mask": [1] * (len(prompt) + len(chosen)),
                     "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected,
                     "rejected_attention_mask": [1] * (len(prompt) + len(rejected)),
                     "rejected_labels": [-100] * len(prompt) + rejected})
    kind = draw(st.sampled_from(["missing", "junk", "mask_length", "logps", "empty", "not_mapping"]))
    row = draw(st.sampled_from(rows))
    key = draw(st.sampled_from(sorted(rows[0])))
    if kind == "missing":
        if len(rows) == 1:
            rows.append(dict(rows[0]))
        del rows[-1][key]
    elif kind == "junk":
        row[key] = draw(junk)
    elif kind == "mask_length":
        base = key.rsplit("_", 2)[0] if key.endswith("attention_mask") else key.split("_")[0]
        row[f"{base}_attention_mask"] = [1] * (len(row[f"{base}_input_ids"]) + 2)
    elif kind == "logps":
        for r in rows:
            r["reference_chosen_logps"] = -1.0
        row["reference_chosen_logps"] = draw(st.sampled_from([float("nan"), float("-inf"), "x", None]))
    elif kind == "empty":
        return []
    elif kind == "not_mapping":
        rows[0] = draw(st.sampled_from([[1, 2, 3], "text", None]))
    return rows


@SETTINGS
@given(broken_dpo_features())
def test_dpo_collator_rejects_malformed_features(features):
    with pytest.raises(ValueError, match="DPO|feature|column|input_ids|attention_mask|labels|logps|empty"):
        DPODataCollatorWithPadding(pad_token_id=0)(features)


@SETTINGS
@given(st.one_of(st.just([]), st.lists(st.one_of(st.just({"input_ids": []}), st.just({"input_ids": "abc"}),
                                               st.just({"input_ids": [1.5, 2.0]}), st.just({"text": [1, 2]}),
                                               st.just({"input_ids": [-3, 4]})), min_size=1, max_size=3)))
def test_completion_only_collator_rejects_malformed_examples(examples):
    collator = DataCollatorForCompletionOnlyLM(" Answer:", tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="input_ids|example|empty"):
        collator(examples)


def test_valid_features_still_collate():
    reward = RewardDataCollatorWithPadding(TOKENIZER)([
        {"input_ids_chosen": [5, 6], "attention_mask_chosen": [1, 1], "input_ids_rejected": [7],
         "attention_mask_rejected": [1], "margin": 0.5}])
    assert reward["input_ids_chosen"].shape == (1, 2) and reward["margin"].tolist() == [0.5]
    dpo = DPODataCollatorWithPadding(0)([{"prompt_input_ids": [5], "chosen_labels": [-100, 6], "prompt": "p"}])
    assert dpo["chosen_labels"].tolist() == [[-100, 6]] and dpo["prompt"] == ["p"]


# ---------------------------------------------------------------------------------------------- data readers


@SETTINGS
@given(data=st.binary(min_size=1, max_size=200), suffix=st.sampled_from([".jsonl", ".csv", ".txt"]))
def test_readers_turn_any_bytes_into_text_or_a_clear_data_format_error(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("reader") / f"incoming{suffix}"
    path.write_bytes(data)
    for read in (lambda: read_text_records(path), lambda: validate_batch(path), lambda: read_jsonl(path)):
        try:
            result = read()
        except DataFormatError as error:
            assert path.name in str(error)  # the error names the file (and the line when there is one)
            continue
        except ValueError as error:
            pytest.fail(f"{type(error).__name__} without the file name: {error}")
        texts = result if isinstance(result, list) else getattr(result, "rows", [])
        assert all(isinstance(t, (str, dict)) for t in texts)


@SETTINGS
@given(records=st.lists(st.dictionaries(st.sampled_from(["text", "txt", "prompt", "chosen"]),
                                        st.one_of(st.text(max_size=5), st.integers(), st.none()), max_size=3),
                        min_size=1, max_size=4))
def test_jsonl_records_with_missing_or_wrong_fields_name_the_line(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("reader") / "reviews.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    try:
        texts = read_text_records(path)
    except DataFormatError as error:
        assert "reviews.jsonl" in str(error) and ("line" in str(error) or ":" in str(error))
        return
    assert len(texts) == len(records) and all(isinstance(t, str) and t for t in texts)
