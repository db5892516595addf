"""Issue 12 (pipeline side): outputs are a function of inputs, the checkout lock, the mid-run params edit."""

from __future__ import annotations

from pathlib import Path

from rlhf_core.tracking import NullTracker
from tasks.tracking import StageRun


def test_model_card_in_the_dvc_tracked_output_holds_no_run_id(tmp_path, monkeypatch):
    """Issue 12.6: a retrained stage with the same weights must keep its hash; the card embedded the MLflow run id."""
    logged = []
    monkeypatch.setattr(StageRun, "_direct", lambda self, what, call: logged.append(what))
    texts = []
    for run_id in ("run0000aaaa", "run1111bbbb"):
        out = tmp_path / run_id
        run = StageRun("sft", tmp_path, run_id, "1", input_hashes={"data/sft_train.jsonl": "abc"},
                       tracker=NullTracker())
        run.write_model_card(out, "SFTTrainer", "tiny", {"lr": 0.1}, {"loss": 1.0})
        texts.append((out / "README.md").read_text())
        assert run_id not in texts[-1] and "git commit" not in texts[-1]
    assert texts[0] == texts[1] and "data/sft_train.jsonl" in texts[0]
    assert logged == ["model card", "model card"]  # the MLflow copy (with provenance) is still logged
