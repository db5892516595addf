"""Workload (g): is rlhf_core's decode (static cache, CUDA graphs on a GPU) the model's own greedy choice?

    python bench/workloads/decode_parity.py --lib ours --args '{"size": "tiny", "precision": "fp32", ...}'

``PPOTrainer.generate`` decodes greedily (``do_sample=False``) on left-padded prompts through the static-cache
decoder; then one full forward of transformers over each prompt + response (no cache, no graph, the prompt's own
positions) re-scores every generated position. A correct decoder picks, at every step, the token that full
forward ranks first: the printed ``gap`` is the full forward's top logit minus the logit of the chosen token
(0 when they agree), its maximum over every generated token, and how many tokens exceed the tolerance.
``"precision"``: ``"fp32"`` (fp32 weights pinned: on a GPU PPOConfig's default would pick bf16 ones; tolerance
1e-3) or ``"default"`` (what a user gets: bf16 weights and bf16 mixed precision on a bf16 GPU, fp32 on a CPU;
tolerance 0.25, as bf16 rounding can flip near-ties). Sequences are also compared with transformers' own greedy
``generate`` in the same precision (a near-tie can make them part; the gap says whether that was a tie or a
fault). TF32 is off, so fp32 means fp32. Prints one JSON line.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

TOLERANCE = {"fp32": 1e-3, "default": 0.25}


def ours_greedy(args: dict, tokenizer, queries, precision: str) -> list:
    PPOConfig, PPOTrainer, _, _ = common.library("ours")
    policy = common.load_policy("ours", common.ensure_random_checkpoint(args.get("size", "tiny"), seed=0))
    config = PPOConfig(batch_size=len(queries), mini_batch_size=len(queries), seed=0, model_name="bench-parity",
                       accelerator_kwargs={"mixed_precision": "bf16"} if precision == "default" else {},
                       **common.bf16_weights_kwargs("ours", {"bf16_weights": "default" if precision == "default"
                                                              else False}))
    trainer = PPOTrainer(config, policy, None, tokenizer)
    return trainer.generate(queries, return_prompt=False, do_sample=False, max_new_tokens=args["max_new_tokens"],
                            pad_token_id=tokenizer.eos_token_id)


def full_forward_gaps(model, queries, responses, device) -> list[float]:
    """Per generated token: the full forward's top logit minus the chosen token's logit (one sequence at a time, no
    padding, so nothing but the model's own arithmetic decides)."""
    import torch

    gaps = []
    with torch.no_grad():
        for query, response in zip(queries, responses):
            ids = torch.cat([query, response.to(query.device)]).to(device)[None]
            logits = model(input_ids=ids).logits[0, len(query) - 1: -1].float()
            chosen = logits.gather(-1, ids[0, len(query):, None])[:, 0]
            gaps.extend((logits.max(-1).values - chosen).tolist())
    return gaps


def hf_greedy(model, tokenizer, queries, args: dict, device) -> list:
    """transformers' own greedy ``generate`` on one left-padded batch, cut after the first eos."""
    import torch

    ids, mask = common.left_padded(queries, tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=args["max_new_tokens"], pad_token_id=tokenizer.eos_token_id,
                             suppress_tokens=[tokenizer.pad_token_id])[:, ids.shape[1]:].cpu()
    return common.cut_after_eos(out, tokenizer.eos_token_id)


def main():
    lib, args = common.parse_args(("ours",))
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = common.load_tokenizer(common.tokenizer_json_path("default"))
    vocab = min(len(tokenizer), common.SIZES[args.get("size", "tiny")]["vocab_size"])
    queries, _, _ = common.synthetic_batch(args["num_prompts"], tuple(args["query_len"]), (1, 1), vocab, seed=2)
    checkpoint = common.ensure_random_checkpoint(args.get("size", "tiny"), seed=0)
    reference = common.load_transformer(checkpoint)[0].to(device).eval()  # fp32: the judge of every decode
    precision = args.get("precision", "fp32")  # one per process: accelerate's state is process-wide
    from rlhf_core.trainers.decode import DECODE_STATS

    responses = ours_greedy(args, tokenizer, queries, precision)
    gaps = full_forward_gaps(reference, queries, responses, device)
    bf16 = precision == "default" and device == "cuda"  # the default samples in bf16 on a GPU only
    typed = common.load_transformer(checkpoint)[0].to(device, torch.bfloat16) if bf16 else reference
    theirs = hf_greedy(typed, tokenizer, queries, args, device)
    same = sum(len(a) == len(b) and bool((a.cpu() == b.cpu()).all()) for a, b in zip(responses, theirs))
    result = {"lib": common.version_of(lib), "precision": precision, "prompts": len(queries), "tokens": len(gaps),
              "max_gap": max(gaps), "tolerance": TOLERANCE[precision],
              "over_tolerance": sum(g > TOLERANCE[precision] for g in gaps),
              "same_as_transformers_generate": same, "decode_stats": DECODE_STATS}
    common.emit(result)


if __name__ == "__main__":
    main()
