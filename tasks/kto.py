"""Stage ``kto``: KTOTrainer (TRL 1.16 API) of the SFT policy on the unpaired thumbs-up/down ratings
(``data/ratings.jsonl``: prompt, completion, label), reference = a frozen copy of the SFT policy. Writes
``models/kto``, ``metrics/kto.json``, ``plots/kto.csv`` and ``plots/kto_windows.csv`` (held-out samples every
``kto.sample_every`` steps: a table and a reward-KL point, tasks/samples.py); off when ``kto.enabled`` is false
(placeholder outputs, see tasks/policy.py).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.logs import get_logger
from tasks.outputs import write_csv, write_json
from tasks.params import cross_section_values, load_stage
from tasks.policy import disabled_placeholder, last_fifth_mean, load_sft_policy, train_policy, trainer_arguments

COLUMNS = ("step", "loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins")
"""plots/kto.csv: per logged step (``kl``: the batch's KL reference point)."""


@task(name="kto", cache_policy=NO_CACHE)  # training: no retries
def kto_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/kto``; returns the metrics written to metrics/kto.json (``{"enabled": false}`` when off)."""
    from tasks.samples import sample_windows, write_empty_windows

    if (skipped := disabled_placeholder(root, "kto", COLUMNS)) is not None:
        write_empty_windows(root, "kto")
        return skipped
    from datasets import Dataset

    from rlhf_core import KTOConfig, KTOTrainer, set_seed
    from rlhf_core.data import read_ratings
    from tasks.stage_run import stage_run

    root, params, p, io = load_stage(root, "kto")
    ratings_path, sft_dir, eval_prompts_path = io["deps"]
    ratings = read_ratings(root / ratings_path)  # every row validated; errors name the file and line
    labels = [r["label"] for r in ratings]
    if not any(labels) or all(labels):
        raise ValueError(f"{ratings_path}: KTO needs both desirable and undesirable rows "
                         f"({sum(labels)} of {len(labels)} are label: true)")
    with stage_run("kto", root, p, io["deps"], parent_run_id, reads=cross_section_values(params, "kto")) as run:
        set_seed(p.seed)
        tokenizer, model = load_sft_policy(root, sft_dir)
        dataset = Dataset.from_dict({c: [r[c] for r in ratings] for c in ("prompt", "completion", "label")})
        run.log_dataset(root / ratings_path, "ratings")
        get_logger().info("kto: %d ratings (%d desirable), beta %.3g", len(ratings), sum(labels), p.beta)

        windows = None

        def build(ck):
            nonlocal windows
            windows, windows_callback = sample_windows("kto", root, params, run, ck.dir / "sample_windows.json",
                                                       eval_prompts_path, sft_dir)
            return KTOTrainer(model, ref_model=None, args=trainer_arguments(KTOConfig, p, ck.dir),
                              train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[ck.callback, windows_callback], tracker=run.tracker)

        trainer, rows = train_policy("kto", root, run, p, build, io["outs"][0],
                                     ("KTOTrainer", f"{sft_dir} (SFT policy; also the reference)"), COLUMNS)
        metrics = {"enabled": True, "final_loss": last_fifth_mean(rows, "loss"), "kl_last": last_fifth_mean(rows, "kl"),
                   "final_reward_margin": last_fifth_mean(rows, "rewards/margins"), "num_ratings": len(ratings),
                   "num_desirable": sum(labels), "steps": trainer.state.global_step,
                   "num_processes": trainer.args.world_size}
        write_json(root / io["metrics"][0], metrics)
        write_csv(root / io["plots"][0], rows, list(COLUMNS))
        windows.write(root / io["plots"][1])
        run.log_metrics({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        run.summary.update(metrics)
    return metrics
