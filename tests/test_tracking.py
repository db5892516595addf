"""Trackers: what reaches MLflow and TensorBoard, and what never does (secrets)."""

import json
import warnings

import numpy as np
import pytest
import torch

from rlhf_core.tracking import MemoryTracker, NullTracker, make_tracker, public_params, scalar_metrics


def test_scalar_metrics_keep_finite_scalars_only():
    stats = {"a": 1.5, "b": np.float32(2.0), "c": torch.tensor(3.0), "d": np.ones(3), "e": float("nan"), "f": "x",
             "g": np.array([4.0])}
    assert scalar_metrics(stats) == {"a": 1.5, "b": 2.0, "c": 3.0, "g": 4.0}


def test_secret_looking_params_are_dropped():
    params = {"learning_rate": 1e-3, "hub_token": "abc", "db_password": "x", "api_key": "k", "SECRET_thing": 1}
    assert public_params(params) == {"learning_rate": 1e-3}


def test_make_tracker_choices():
    assert isinstance(make_tracker(None), NullTracker)
    memory = MemoryTracker()
    assert make_tracker(memory) is memory
    with pytest.raises(ValueError, match="log_with"):
        make_tracker("wandb-typo")


def test_mlflow_tracker_logs_metrics_tables_and_params(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = make_tracker("mlflow", project_name="tracker-test")
    run_id = mlflow.active_run().info.run_id
    tracker.log_params({"learning_rate": 0.1, "hub_token": "never"})
    tracker.log({"objective/kl": 0.5, "ppo/loss/total": torch.tensor(1.25), "dist": np.ones(4)}, step=3)
    tracker.log_table("game_log", ["query", "response", "reward"], [["q", "r", 1.0]], step=3)
    tracker.finish()
    run = mlflow.get_run(run_id)
    assert run.data.metrics == {"objective/kl": 0.5, "ppo/loss/total": 1.25}
    assert run.data.params == {"learning_rate": "0.1"}
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run_id, "tables")]
    assert artifacts == ["tables/game_log_step000003.json"]


def test_mlflow_tracker_logs_a_table_every_step_past_what_mlflows_table_list_holds(tmp_path, monkeypatch):
    """MLflow lists a run's tables in one tag cut at 8,000 characters: a PPO run logging its game_log every step
    overflowed it after ~130 steps, and every later ``mlflow.log_table`` raised. Past that, the tables are still
    written (the same JSON) and nothing is raised or warned per step."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = make_tracker("mlflow", project_name="tracker-tables")
    run_id = mlflow.active_run().info.run_id
    steps = 180
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed log_table warns so: none may
        for step in range(steps):
            tracker.log_table("game_log", ["query", "response", "reward"], [["q", f"r{step}", 1.0]], step=step)
    tracker.finish()
    client = mlflow.MlflowClient()
    files = [a.path for a in client.list_artifacts(run_id, "tables")]
    assert files == [f"tables/game_log_step{s:06d}.json" for s in range(steps)]
    listed = json.loads(mlflow.get_run(run_id).data.tags[MLFLOW_LOGGED_ARTIFACTS])  # still parses
    assert 100 < len(listed) < steps and listed[0] == {"path": "tables/game_log_step000000.json", "type": "table"}
    first, last = (json.loads(open(client.download_artifacts(run_id, f, str(tmp_path))).read())
                   for f in (files[0], files[-1]))
    assert last == {"columns": ["query", "response", "reward"], "data": [["q", f"r{steps - 1}", 1.0]]}
    assert first == {**last, "data": [["q", "r0", 1.0]]}  # unlisted tables are the same JSON as listed ones


def test_tensorboard_tracker_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    tracker = make_tracker("tensorboard", project_name="tb", logging_dir=str(tmp_path))
    tracker.log({"objective/kl": 0.5}, step=1)
    tracker.log_table("game_log", ["query", "response"], [["q", "r"]], step=1)
    tracker.finish()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_ppo_trainer_takes_a_ready_tracker_as_tracker_argument(tokenizer):
    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import tiny_causal_lm

    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    memory = MemoryTracker()
    config = PPOConfig(batch_size=2, mini_batch_size=1, ppo_epochs=1)
    trainer = PPOTrainer(config, model, None, tokenizer, tracker=memory)
    assert trainer.tracker is memory and config.log_with is None  # not smuggled through the config
    assert memory.params["batch_size"] == 2  # the config was logged to the tracker it was given


def test_spooling_tracker_public_hooks(tmp_path):
    from rlhf_core.tracking import SpoolingTracker

    seen = []

    class Named(SpoolingTracker):
        remind_on_finish = False

        def spool_file_name(self) -> str:
            return "stage-x.jsonl"

        def offline_message(self, error: BaseException) -> str:
            return f"offline: {error}"

        def on_offline(self, error: BaseException) -> None:
            seen.append(str(error))

    def refuse(project_name, run_name):
        raise ConnectionError("refused")

    with pytest.warns(RuntimeWarning, match="offline: refused"):
        tracker = Named(refuse, spool_dir=tmp_path, project_name="p", run_name="x")
    tracker.log({"loss": 1.0}, step=1)
    tracker.go_offline(ConnectionError("again"))  # already offline: no second spool, no second hook call
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remind_on_finish=False: finish warns no more
        tracker.finish()
    assert seen == ["refused"] and tracker.spool_path == tmp_path / "stage-x.jsonl"
    kinds = [json.loads(line)["kind"] for line in tracker.spool_path.read_text().splitlines()]
    assert kinds == ["run", "metrics", "finish"]


def test_secret_filter_matches_whole_words_not_substrings():
    """Issue 12.6: ``ppo.max_new_tokens`` contains "token" but is no secret; dropping it made logged params
    unable to reproduce a run."""
    kept = {"ppo.max_new_tokens": 20, "pad_token_id": 1, "tokenizer_name": "t", "num_tokens": 3, "keyword": "x",
            "secretary_count": 2, "passwords_seen": 0}
    secret = {"hub_token": 1, "ppo.hf_token": 1, "accessToken": 1, "token": 1, "db_password": 1, "api_key": 1,
              "apiKey": 1, "tracker.API-KEY": 1, "SECRET_thing": 1, "aws_secret_access_key": 1, "credentials": 1}
    assert public_params({**kept, **secret}) == kept


def test_tensor_numpy_and_string_values_are_converted():
    from rlhf_core.tracking import plain_value

    assert scalar_metrics({"a": "0.25", "b": "abc", "c": torch.tensor([[2.0]]), "d": np.int64(3)}) == {
        "a": 0.25, "c": 2.0, "d": 3.0}
    assert plain_value(torch.tensor([1.0, 2.0])) == [1.0, 2.0] and plain_value(np.float32(0.5)) == 0.5
    assert plain_value(torch.tensor(7)) == 7 and plain_value("x") == "x" and plain_value(torch.zeros(0)) == []


def test_log_stats_columns_with_tensor_numpy_and_string_values_reach_mlflow(tmp_path, monkeypatch):
    """Issue 11.6: a tensor in a log_stats column was reported as "backend unreachable" and spooled."""
    import json
    import warnings

    mlflow = pytest.importorskip("mlflow")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    mlflow.set_tracking_uri(store)
    tracker = make_tracker("mlflow", project_name="values", spool_dir=str(tmp_path / "spool"))
    run_id = tracker.run_id
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.log({"kl": torch.tensor(0.5), "mean": np.float64(1.5), "text_number": "2.5", "dist": np.ones(3)}, step=1)
        tracker.log_table("game_log", ["query", "response", "reward", "ids"],
                          [[torch.tensor(3), "good", torch.tensor(0.75), np.array([1, 2])],
                           ["q", np.str_("bad"), np.float32(-0.5), torch.tensor([4, 5])]], step=1)
        tracker.finish()
    assert not tracker.offline and not (tmp_path / "spool").exists()
    assert not [w for w in caught if "unreachable" in str(w.message) or "not logged" in str(w.message)]
    run = mlflow.get_run(run_id)
    assert run.data.metrics == {"kl": 0.5, "mean": 1.5, "text_number": 2.5}
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="tables/game_log_step000001.json",
                                                dst_path=str(tmp_path / "dl"))
    table = json.loads(open(local).read())
    assert table["columns"] == ["query", "response", "reward", "ids"]
    assert table["data"] == [[3, "good", 0.75, "[1, 2]"], ["q", "bad", -0.5, "[4, 5]"]]
