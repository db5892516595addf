"""DPO under f-divergences ("Beyond Reverse KL", Wang et al. 2023), as classic TRL 0.11.4's dpo_loss computes them.

The DPO logit of an f-divergence is ``f'(u_w) - f'(u_l)`` with ``u = pi / pi_ref``; the loss is then the usual
``-log sigmoid(beta * logit)``. Expected values are naive float64 loops over ``math`` functions.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from rlhf_core.losses import capped_exp, dpo_loss, f_divergence_logits
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.preference.dpo import DPOConfig, DPOTrainer, FDivergenceType

PC = torch.tensor([-3.0, -1.5, -7.25, -0.5], dtype=torch.float64)  # policy chosen log-probs (B=4,)
PR = torch.tensor([-4.0, -1.0, -6.0, -2.5], dtype=torch.float64)  # policy rejected
RC = torch.tensor([-3.5, -1.25, -7.0, -1.0], dtype=torch.float64)  # reference chosen
RR = torch.tensor([-3.75, -1.5, -6.5, -2.0], dtype=torch.float64)  # reference rejected
BETA = 0.3


def f_prime(kind: str, u: float, alpha: float) -> float:
    """f'(u) of each divergence, written from its f (paper, Table 1)."""
    if kind == "reverse_kl":  # f(u) = u log u
        return math.log(u) + 1
    if kind == "js_divergence":  # f(u) = u log u - (1 + u) log((1 + u) / 2)
        return math.log(2 * u / (1 + u))
    return (1 - u ** -alpha) / alpha  # alpha: f(u) = (u^(1-a) - (1-a) u - a) / (a (a - 1))


def f_value(kind: str, u: float, alpha: float) -> float:
    """f(u) itself, to check f_prime by a central difference."""
    if kind == "reverse_kl":
        return u * math.log(u)
    if kind == "js_divergence":
        return u * math.log(u) - (1 + u) * math.log((1 + u) / 2)
    return (u ** (1 - alpha) - (1 - alpha) * u - alpha) / (alpha * (alpha - 1))


def naive_losses(kind: str, alpha: float = 0.5) -> list[float]:
    """-log sigmoid(beta * (f'(u_w) - f'(u_l))) pair by pair, in float64."""
    out = []
    for i in range(len(PC)):
        u_w = math.exp(PC[i].item() - RC[i].item())
        u_l = math.exp(PR[i].item() - RR[i].item())
        logit = f_prime(kind, u_w, alpha) - f_prime(kind, u_l, alpha)
        out.append(math.log1p(math.exp(-BETA * logit)))
    return out


@pytest.mark.parametrize("kind", ["reverse_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("u", [0.2, 1.0, 3.5])
def test_f_prime_is_the_derivative_of_f(kind, u):
    h = 1e-6
    numeric = (f_value(kind, u + h, 0.5) - f_value(kind, u - h, 0.5)) / (2 * h)
    assert f_prime(kind, u, 0.5) == pytest.approx(numeric, rel=1e-7, abs=1e-8)


@pytest.mark.parametrize("kind", ["reverse_kl", "js_divergence", "alpha_divergence"])
def test_dpo_loss_matches_naive_float64_per_divergence(kind):
    losses, chosen, rejected = dpo_loss(PC, PR, RC, RR, beta=BETA, f_divergence_type=kind, f_alpha_divergence_coef=0.5)
    assert losses.dtype == torch.float64 and losses.shape == (4,)
    assert losses.tolist() == pytest.approx(naive_losses(kind), rel=1e-12, abs=1e-14)
    # the implicit rewards are the log-ratios whatever the divergence
    assert chosen.tolist() == pytest.approx((BETA * (PC - RC)).tolist(), rel=1e-15)
    assert rejected.tolist() == pytest.approx((BETA * (PR - RR)).tolist(), rel=1e-15)


def test_alpha_divergence_small_alpha_tends_to_reverse_kl_and_reverse_kl_is_unchanged():
    plain, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA)
    explicit, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA, f_divergence_type="reverse_kl")
    assert torch.equal(plain, explicit)
    near_zero, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA, f_divergence_type="alpha_divergence",
                               f_alpha_divergence_coef=1e-7)
    assert torch.allclose(near_zero, plain, rtol=0, atol=1e-6)


def test_f_divergence_logits_exact_values_and_reference_free():
    lw = torch.tensor([0.5, -1.0], dtype=torch.float64)  # log u_w (B=2,)
    ll = torch.tensor([-0.25, 2.0], dtype=torch.float64)  # log u_l
    js = f_divergence_logits(lw, ll, lw - ll, "js_divergence")
    expected = [math.log(2 * math.exp(a) / (1 + math.exp(a))) - math.log(2 * math.exp(b) / (1 + math.exp(b)))
                for a, b in zip(lw.tolist(), ll.tolist())]
    assert js.tolist() == pytest.approx(expected, rel=1e-13)
    alpha = f_divergence_logits(lw, ll, lw - ll, "alpha_divergence", alpha=2.0)
    assert alpha.tolist() == pytest.approx([(math.exp(-2 * b) - math.exp(-2 * a)) / 2 for a, b in
                                            zip(lw.tolist(), ll.tolist())], rel=1e-13)
    # reference-free: u = pi (reference log-probs taken as 0)
    free, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA, reference_free=True, f_divergence_type="js_divergence")
    want = [math.log1p(math.exp(-BETA * (f_prime("js_divergence", math.exp(c), 0) -
                                         f_prime("js_divergence", math.exp(r), 0))))
            for c, r in zip(PC.tolist(), PR.tolist())]
    assert free.tolist() == pytest.approx(want, rel=1e-12)


def test_capped_exp_stays_finite_at_the_dtype_limit():
    # cap = log(finfo.max) rounded down to 4 decimals: 88.7228 (float32), 709.7827 (float64)
    big32 = capped_exp(torch.tensor([1000.0, 1.0], dtype=torch.float32))
    assert torch.isfinite(big32).all() and big32[0] == torch.exp(torch.tensor(88.7228)) and big32[1] == math.e
    big64 = capped_exp(torch.tensor([1e4], dtype=torch.float64))
    assert big64.item() == pytest.approx(math.exp(709.7827), rel=1e-12)
    # TRL 0.11.4's test inputs (log-ratios of hundreds) give finite alpha-divergence losses in float32
    losses, _, _ = dpo_loss(torch.tensor([410.0, 0.1]), torch.tensor([810.5, 0.2]), torch.tensor([-610.0, -0.1]),
                            torch.tensor([110.6, 0.5]), f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5)
    assert torch.isfinite(losses).all()


def test_unknown_divergence_and_zero_alpha_are_refused():
    with pytest.raises(ValueError, match="f_divergence_type must be one of"):
        dpo_loss(PC, PR, RC, RR, f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="f_alpha_divergence_coef must be non-zero"):
        dpo_loss(PC, PR, RC, RR, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.0)


def test_trainer_dpo_loss_uses_the_config_divergence(tokenizer, tmp_path):
    rows = {"prompt": ["The film was"] * 2, "chosen": [" great"] * 2, "rejected": [" awful"] * 2}
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                     f_divergence_type=FDivergenceType.JS_DIVERGENCE.value, f_alpha_divergence_coef=0.5, beta=BETA)
    trainer = DPOTrainer(model=tiny_causal_lm(tokenizer), args=args, tokenizer=tokenizer,
                         train_dataset=Dataset.from_dict(rows), max_length=16, max_prompt_length=8)
    assert trainer.f_divergence_type == "js_divergence"
    assert trainer.f_divergence_params == {"alpha_divergence_coef": 0.5}
    losses, _, _ = trainer.dpo_loss(PC, PR, RC, RR)
    assert losses.tolist() == pytest.approx(naive_losses("js_divergence"), rel=1e-12)
    with pytest.raises(ValueError, match="DPOConfig.f_alpha_divergence_coef must be non-zero"):
        DPOTrainer(model=tiny_causal_lm(tokenizer), tokenizer=tokenizer, train_dataset=Dataset.from_dict(rows),
                   args=DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                  f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.0))
