"""params.yaml, the dataclasses of tasks/params.py and dvc.yaml agree; the loader rejects bad keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tasks.params import (
    SECTIONS,
    STAGES,
    ParamsError,
    PPOParams,
    apply_overrides,
    load_params,
    parse_params,
    read_raw,
    stage_io,
    stage_param_keys,
)

ROOT = Path(__file__).resolve().parents[1]
PPO_STAGE_ONLY = {"total_steps", "max_new_tokens", "reward"}


@pytest.fixture(scope="module")
def raw():
    return read_raw(ROOT / "params.yaml")


@pytest.fixture(scope="module")
def dvc_stages():
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _names(entries):
    """dvc.yaml list entries are strings or one-key mappings (path: options)."""
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def test_params_yaml_sections_mirror_dataclasses(raw):
    assert list(raw) == list(SECTIONS)
    for name, cls in SECTIONS.items():
        assert list(raw[name]) == [f.name for f in dataclasses.fields(cls)], name
    load_params(ROOT / "params.yaml")  # types and cross-field rules


def test_dvc_stages_in_order(dvc_stages):
    assert tuple(dvc_stages) == STAGES


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_stage_matches_params_and_io(stage, dvc_stages, raw):
    entry = dvc_stages[stage]
    io = stage_io(load_params(ROOT / "params.yaml").paths)[stage]
    assert entry["cmd"] == f"python -m flows.stage {stage}"
    # exactly the keys of its own section, nothing else
    assert entry["params"] == stage_param_keys(stage)
    assert all(key.split(".", 1)[1] in raw[stage] for key in entry["params"])
    deps = _names(entry["deps"])
    data_deps = [d for d in deps if not d.endswith(".py")]
    assert data_deps == io["deps"]
    code_deps = [d for d in deps if d.endswith(".py")]
    assert f"tasks/{stage}.py" in code_deps
    for dep in code_deps:
        assert (ROOT / dep).is_file(), f"{stage}: code dep {dep} does not exist"
    assert _names(entry.get("outs")) == io["outs"]
    assert _names(entry["metrics"]) == io["metrics"] == [f"metrics/{stage}.json"]
    assert _names(entry["plots"]) == io["plots"] == [f"plots/{stage}.csv"]
    for kind in ("metrics", "plots"):  # git-tracked, as DVC recommends for small metrics and plots
        assert all(e[next(iter(e))]["cache"] is False for e in entry[kind])
    for out in io["outs"]:
        assert out.startswith(("data/", "models/"))


def test_outputs_feed_downstream_stages(dvc_stages):
    produced = {o for s in dvc_stages.values() for o in _names(s.get("outs"))}
    for stage, entry in dvc_stages.items():
        for dep in _names(entry["deps"]):
            if dep.startswith(("data/", "models/")):
                assert dep in produced, f"{stage} depends on {dep}, which no stage produces"


def test_ppo_params_are_ppo_config_fields():
    config_mod = pytest.importorskip("rlhf_core.trainers.ppo_config")
    config_fields = {f.name for f in dataclasses.fields(config_mod.PPOConfig)}
    ours = {f.name for f in dataclasses.fields(PPOParams)} - PPO_STAGE_ONLY
    assert ours <= config_fields, ours - config_fields


def test_unknown_key_rejected(raw):
    bad = apply_overrides(raw, {})
    bad["ppo"]["learning_rat"] = 1e-4
    with pytest.raises(ParamsError, match=r"unknown key\(s\) in section 'ppo': learning_rat"):
        parse_params(bad)


def test_missing_key_rejected(raw):
    bad = apply_overrides(raw, {})
    del bad["sft"]["hidden_size"]
    with pytest.raises(ParamsError, match=r"missing key\(s\) in section 'sft': hidden_size"):
        parse_params(bad)


def test_unknown_and_missing_sections_rejected(raw):
    bad = apply_overrides(raw, {})
    bad["grpo"] = {}
    with pytest.raises(ParamsError, match="unknown section"):
        parse_params(bad)
    bad = apply_overrides(raw, {})
    del bad["evaluate"]
    with pytest.raises(ParamsError, match="missing section"):
        parse_params(bad)


def test_wrong_type_rejected(raw):
    with pytest.raises(ParamsError, match=r"ppo.batch_size: expected int"):
        parse_params(apply_overrides(raw, {"ppo.batch_size": "64"}))
    # an int where a float is declared is fine (YAML writes 1 for 1.0)
    assert parse_params(apply_overrides(raw, {"ppo.learning_rate": 1})).ppo.learning_rate == 1.0


def test_cross_field_rule(raw):
    with pytest.raises(ParamsError, match="multiple of ppo.mini_batch_size"):
        parse_params(apply_overrides(raw, {"ppo.batch_size": 10, "ppo.mini_batch_size": 4}))


def test_override_of_unknown_key_rejected(raw):
    with pytest.raises(ParamsError, match="no such key"):
        apply_overrides(raw, {"ppo.nope": 1})


@pytest.mark.parametrize("key", ["models", "data", "metrics", "plots", "incoming"])
def test_output_path_escaping_the_project_is_rejected(tmp_path, raw, key):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "params.yaml").write_text(yaml.safe_dump(apply_overrides(raw, {f"paths.{key}": "../escape"})))
    with pytest.raises(ValueError, match=rf"paths\.{key}: output path '\.\./escape' .*outside the project"):
        load_params(project / "params.yaml")
    # an absolute path elsewhere is the same escape
    (project / "params.yaml").write_text(yaml.safe_dump(apply_overrides(raw, {f"paths.{key}": str(tmp_path / "x")})))
    with pytest.raises(ParamsError, match=rf"paths\.{key}"):
        load_params(project / "params.yaml")
    # explicitly allowed: accepted
    allowed = apply_overrides(raw, {f"paths.{key}": "../escape", "paths.allow_outside": True})
    (project / "params.yaml").write_text(yaml.safe_dump(allowed))
    assert getattr(load_params(project / "params.yaml").paths, key) == "../escape"


def test_symlink_out_of_the_project_is_rejected(tmp_path, raw):
    project, outside = tmp_path / "proj", tmp_path / "elsewhere"
    project.mkdir()
    outside.mkdir()
    (project / "models").symlink_to(outside)
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match=r"paths\.models: .*outside the project"):
        load_params(project / "params.yaml")


# issue 12.6: every bad value fails in the loader, before any stage runs, naming its key.
BAD_VALUES = [
    ("ppo.mini_batch_size", 0), ("ppo.batch_size", -64), ("sft.per_device_train_batch_size", -1),
    ("dpo.per_device_train_batch_size", 0), ("ppo.kl_penalty", "bogus"), ("ppo.ppo_epochs", 0),
    ("ppo.learning_rate", -1e-4), ("ppo.learning_rate", float("nan")), ("sft.learning_rate", 0.0),
    ("dpo.beta", -0.1), ("dpo.beta", float("nan")), ("sft.num_train_epochs", float("inf")),
    ("dpo.num_train_epochs", float("inf")), ("sft.arch", "bert"), ("sft.max_seq_length", 97),
    ("dpo.max_length", 200), ("reward_model.max_length", 128), ("ppo.max_new_tokens", 96),
    ("ppo.max_new_tokens", 49), ("evaluate.max_new_tokens", 49),  # 48-token prompt budget + 49 > 96 positions
    ("ppo.gamma", 1.5), ("ppo.lam", -0.1), ("ppo.total_steps", 0), ("evaluate.batch_size", 0),
    ("paths.metrics", ".git"), ("paths.models", ".dvc/cache"), ("paths.data", "sub/.git/x"), ("paths.plots", ""),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_bad_value_rejected_naming_the_key(tmp_path, raw, key, value):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(apply_overrides(raw, {key: value})))
    with pytest.raises(ParamsError, match=rf"params\.yaml: {key.replace('.', r'[.]')}: "):
        load_params(tmp_path / "params.yaml")


def test_positions_rule_only_for_the_built_model(raw):
    # a hub/local model's positions are only known once loaded: not checked here
    parse_params(apply_overrides(raw, {"sft.model_name": "gpt2", "sft.max_seq_length": 512}))
    # the length equal to the positions fits
    parse_params(apply_overrides(raw, {"sft.max_seq_length": raw["sft"]["max_positions"]}))


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("paths:\n  data: data\nppo:\n  learning_rate: [0.1\n  batch_size: 64\n")
    with pytest.raises(ParamsError, match=rf"{path}:\d+:\d+: YAML syntax error: ") as err:
        load_params(path)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    path.write_text("ppo:\n\tlearning_rate: 1\n")  # a tab: line 2, column 1
    with pytest.raises(ParamsError, match=rf"{path}:2:1: YAML syntax error"):
        load_params(path)
