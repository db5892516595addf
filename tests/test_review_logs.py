"""Logs a user reads: expected transformers load reports in one line, Trainer logs as lines, no raw dicts."""

from __future__ import annotations

import logging

import pytest

from tasks.process.logs import explain_load_report, load_report_rows, log_line

REPORT = ("GPT2ForSequenceClassification LOAD REPORT from: /p/models/sft\n"
          "Key          | Status  | \n-------------+---------+-\nscore.weight | \x1b[31mMISSING\x1b[0m | \n\n"
          "Notes:\n- MISSING:\tthose params were newly initialized because missing from the checkpoint.")


def test_expected_load_reports_become_one_line():
    assert load_report_rows(REPORT) == [("score.weight", "MISSING")]
    line = explain_load_report(REPORT)
    assert line.startswith("load GPT2ForSequenceClassification from: /p/models/sft: score.weight: the score head is new")
    assert "\n" not in line
    v_head = REPORT.replace("score.weight | \x1b[31mMISSING", "v_head.summary.{weight, bias} | UNEXPECTED")
    assert "PPO value head is not loaded" in explain_load_report(v_head)


def test_unexpected_rows_keep_the_full_report():
    other = REPORT.replace("score.weight", "transformer.h.0.attn.c_attn.weight")
    assert explain_load_report(other) is None
    mixed = REPORT.replace("score.weight | \x1b[31mMISSING\x1b[0m | ",
                           "score.weight | MISSING | \nlm_head.weight | MISSING | ")
    assert explain_load_report(mixed) is None
    assert explain_load_report("no report here") is None


def test_real_transformers_report_for_a_fresh_score_head(tmp_path):
    from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from tasks.process.logs import install_load_report_filter

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)).save_pretrained(tmp_path)
    install_load_report_filter()
    logger = logging.getLogger("transformers.modeling_utils")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=1)
    finally:
        logger.removeHandler(handler)
    reports = [r for r in records if "score" in r.getMessage()]
    assert len(reports) == 1
    assert reports[0].levelno == logging.INFO and "\n" not in reports[0].getMessage()
    assert "the score head is new" in reports[0].getMessage()


def test_trainer_log_line_is_short_and_has_no_dict():
    line = log_line("sft", 20, 64, {"loss": 1.23456, "grad_norm": 0.5, "learning_rate": 1e-3, "epoch": 0.3125,
                                    "total_flos": 1e9})
    assert line == "sft step 20/64 (epoch 0.31): loss 1.235, learning_rate 0.001"
    assert "{" not in line
    # a KTO/GRPO record (about 25 keys): the headline keys only, at most four, in a line of under 120 characters
    many = {"loss": 0.5, "grad_norm": 1.0, "learning_rate": 5e-4, "reward": 1.5, "reward_std": 0.3, "kl": 0.02,
            "entropy": 1.1, **{f"rewards/x{i}/mean": float(i) for i in range(12)}, "rewards/margins": 0.4,
            "rewards/accuracies": 0.9, "epoch": 0.5}
    line = log_line("grpo", 7, 40, many)
    assert line == "grpo step 7/40 (epoch 0.50): loss 0.5, reward 1.5, kl 0.02, rewards/margins 0.4"
    assert len(line) < 120
    summary = log_line("kto", 40, 40, {"train_runtime": 12.5, "train_loss": 0.25, "train_samples_per_second": 3})
    assert summary == "kto step 40/40: train_runtime 12.5, train_loss 0.25"


def test_about_ten_progress_lines_per_stage_whatever_its_length():
    from tasks.process.logs import shows_progress

    for max_steps in (1, 7, 40, 226, 1000):
        lines = [step for step in range(1, max_steps + 1) if shows_progress(step, max_steps, {"loss": 1.0})]
        assert lines[-1] == max_steps and 1 <= len(lines) <= 11, (max_steps, lines)
    assert shows_progress(3, 40, {"train_runtime": 1.0})  # the end-of-training summary always shows


def test_trainer_prints_no_raw_dicts_and_logs_lines(tmp_path, capsys):
    import torch
    from torch import nn
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from tasks.process.logs import quiet_trainer_output

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(2, 1)

        def forward(self, x, labels=None):
            out = self.w(x).squeeze(-1)
            return {"loss": ((out - labels) ** 2).mean(), "logits": out}

    data = [{"x": torch.tensor([float(i), 1.0]), "labels": torch.tensor(float(i))} for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, logging_steps=2, per_device_train_batch_size=2,
                             report_to=[], disable_tqdm=True, save_strategy="no", use_cpu=True)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=data)
    quiet_trainer_output(trainer, "tiny")
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert "PrinterCallback" not in names and "ProgressCallback" not in names and "StageProgressCallback" in names
    assert not any(isinstance(c, (PrinterCallback, ProgressCallback)) for c in trainer.callback_handler.callbacks)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("rlhf_pipeline").addHandler(handler)
    try:
        trainer.train()
    finally:
        logging.getLogger("rlhf_pipeline").removeHandler(handler)
    out = capsys.readouterr()
    assert "{'loss'" not in out.out + out.err and "{'train_runtime'" not in out.out + out.err
    lines = [r.getMessage() for r in records if r.getMessage().startswith("tiny step")]
    assert [line.split(":")[0] for line in lines] == ["tiny step 2/4 (epoch 0.50)", "tiny step 4/4 (epoch 1.00)",
                                                       "tiny step 4/4 (epoch 1.00)"]
    assert "train_loss" in lines[-1]  # the Trainer's end-of-training summary, as a line


def test_dvc_messages_are_printed_once(monkeypatch):
    import dvc  # noqa: F401  (adds DVC's own console handlers)

    from tasks.process.logs import single_dvc_output

    root = logging.getLogger()
    console = logging.StreamHandler()
    monkeypatch.setattr(root, "handlers", [*root.handlers, console])
    from dvc.logger import LoggerHandler

    dvc_logger = logging.getLogger("dvc")
    # what ``import dvc`` installs (an earlier test in this process may have removed it already)
    monkeypatch.setattr(dvc_logger, "handlers", [*dvc_logger.handlers, LoggerHandler()])
    single_dvc_output()
    assert not any(type(h).__module__.startswith("dvc") for h in dvc_logger.handlers)
    assert dvc_logger.propagate  # the record still reaches the pipeline's handlers (once)


def test_no_weight_loading_bars_under_the_flows():
    from flows.process import configure_process

    environ = {"HF_HUB_DISABLE_PROGRESS_BARS": "0"}
    configure_process(environ)  # what every entry point does first (here into a copy of the environment)
    assert environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"  # a user's own setting stays
    environ = {}
    configure_process(environ)
    assert environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
    assert environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"


def test_known_harmless_messages_are_dropped_and_nothing_else(caplog):
    import logging

    from tasks.process.logs import KNOWN_HARMLESS, quiet_known_messages

    quiet_known_messages()
    quiet_known_messages()  # idempotent: one filter per logger
    for (name, start), why in KNOWN_HARMLESS.items():
        assert why and len([f for f in logging.getLogger(name).filters if type(f).__name__ == "KnownMessageFilter"]) == 1
        with caplog.at_level(logging.INFO, logger=name):
            caplog.clear()
            logging.getLogger(name).warning(start + " (and the rest of the message)")
            logging.getLogger(name).warning("something else went wrong")
        assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]
