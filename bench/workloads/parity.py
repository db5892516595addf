"""Parity probe: one PPO step from identical weights; writes its stats and updated weights.

    python bench/workloads/parity.py --lib ours|trl --args '{"out": "bench/.cache/parity-out", "kl_penalty": "kl", ...}'

Dropout is off everywhere and there is one mini-batch per epoch, so both libraries should compute
the same losses, KL, returns and updated weights (compared by bench/test_parity.py). ``"torch_compile": true``
runs rlhf_core's compiled opt-in and writes ``ours-compiled.*``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

SCALARS = (
    "objective/kl", "objective/kl_coef", "objective/entropy", "ppo/mean_non_score_reward", "ppo/mean_scores",
    "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "ppo/policy/entropy", "ppo/policy/approxkl",
    "ppo/policy/policykl", "ppo/policy/clipfrac", "ppo/policy/advantages_mean", "ppo/returns/mean",
    "ppo/returns/var", "ppo/val/vpred", "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var",
)


def main():
    lib, args = common.parse_args()
    import numpy as np
    import torch
    from safetensors.torch import save_file

    PPOConfig, PPOTrainer, _, _ = common.library(lib)
    ckpt = common.ensure_random_checkpoint(args.get("size", "tiny"), seed=0)
    tokenizer = common.load_tokenizer(common.tokenizer_json_path("default"))
    policy = common.load_policy(lib, ckpt)
    bs = args.get("batch_size", 8)
    config = PPOConfig(batch_size=bs, mini_batch_size=bs, ppo_epochs=args.get("ppo_epochs", 2),
                       learning_rate=args.get("learning_rate", 1e-3), seed=0, kl_penalty=args.get("kl_penalty", "kl"),
                       init_kl_coef=0.2, adap_kl_ctrl=True, model_name="parity",
                       **common.bf16_weights_kwargs(lib, args),  # fp32 weights as classic TRL's, on a GPU too
                       **({"torch_compile": True} if args.get("torch_compile") else {}))  # rlhf_core's opt-in
    trainer = PPOTrainer(config, policy, None, tokenizer)
    queries, responses, scores = common.synthetic_batch(bs, (3, 9), (2, 12), len(tokenizer), seed=3)
    # Perturb the policy away from the reference first so the KL terms are not all zero: a fixed
    # deterministic nudge of the value head and last layer norm, identical in both libraries.
    with torch.no_grad():
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        g = torch.Generator().manual_seed(5)
        for name, p in unwrapped.pretrained_model.named_parameters():
            if name.startswith("transformer.ln_f") or name.startswith("transformer.h.1.mlp"):
                p.add_((0.05 * torch.randn(p.shape, generator=g)).to(p.device))  # drawn on the CPU: same values on a GPU
    stats = trainer.step(queries, responses, scores)
    out = {k: float(np.asarray(stats[k]).mean()) for k in SCALARS}
    out["objective/kl_dist"] = [float(x) for x in np.asarray(stats["objective/kl_dist"]).reshape(-1)]
    weights = {k: v.detach().cpu().contiguous().clone() for k, v in unwrapped.pretrained_model.state_dict().items()
               if k != "lm_head.weight" and not k.endswith(".attn.bias") and not k.endswith("masked_bias")}
    weights.update({f"v_head.summary.{k}": v.detach().cpu().contiguous().clone()
                    for k, v in unwrapped.v_head.summary.state_dict().items()})
    os.makedirs(args["out"], exist_ok=True)
    name = f"{lib}-compiled" if args.get("torch_compile") else lib
    save_file(weights, os.path.join(args["out"], f"{name}.safetensors"))
    with open(os.path.join(args["out"], f"{name}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    common.emit({"lib": common.version_of(lib), "stats": out})


if __name__ == "__main__":
    main()
