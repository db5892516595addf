"""bf16 by default where the card supports it, fp32 elsewhere (issue 23).

Two places decide: ``base.resolve_bf16`` (``bf16=None`` of the Trainer-based configs: DPO, KTO, GRPO, RLOO) and
``master_weights.bf16_by_default`` (``PPOConfig(bf16_weights=None)``). No GPU runs here: the CUDA answers are
reached by patching torch's capability queries, and the CPU answers (every run of the pipeline) are checked as
they are.
"""

from types import SimpleNamespace

import pytest
import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, DPOConfig, GRPOConfig, KTOConfig, PPOConfig, PPOTrainer, RLOOConfig
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.base import resolve_bf16
from rlhf_core.trainers.master_weights import bf16_by_default


@pytest.fixture
def bf16_gpu(monkeypatch):
    """A process that sees a CUDA GPU with bf16 support (only torch's two queries are patched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def _args(**fields):
    return SimpleNamespace(**{"bf16": None, "fp16": False, "use_cpu": False, **fields})


def test_resolve_bf16_picks_bf16_only_on_a_bf16_gpu_without_fp16_or_use_cpu(bf16_gpu, monkeypatch):
    for fields, expected in [({}, True), ({"fp16": True}, False), ({"use_cpu": True}, False),
                             ({"bf16": False}, False), ({"bf16": True, "use_cpu": True}, True)]:
        args = _args(**fields)
        resolve_bf16(args)
        assert args.bf16 is expected, fields  # an explicit value is kept as given
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a V100
    args = _args()
    resolve_bf16(args)
    assert args.bf16 is False


@pytest.mark.parametrize("config_class", [DPOConfig, KTOConfig, GRPOConfig, RLOOConfig])
def test_every_trainer_config_defaults_to_none_and_stays_fp32_on_the_cpu(config_class, tmp_path):
    field = config_class.__dataclass_fields__["bf16"]
    assert field.default is None
    if torch.cuda.is_available():
        pytest.skip("the CPU answer needs a machine without CUDA")
    assert config_class(output_dir=str(tmp_path), report_to="none").bf16 is False


def _optimizer(dtype=torch.float32, stepped=False):
    layer = torch.nn.Linear(2, 2).to(dtype)
    optimizer = torch.optim.Adam(layer.parameters())
    if stepped:
        layer(torch.ones(1, 2, dtype=dtype)).sum().backward()
        optimizer.step()
    return optimizer


def test_bf16_weights_default_is_bf16_on_a_bf16_gpu_with_fp32_weights_and_a_fresh_optimizer(bf16_gpu):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert bf16_by_default(cuda, "no", _optimizer())
    assert bf16_by_default(cuda, "bf16", _optimizer())  # autocast on top: still bf16 weights
    assert not bf16_by_default(cpu, "no", _optimizer())
    assert not bf16_by_default(cuda, "fp16", _optimizer())  # fp16 loss scaling keeps its own scheme
    assert not bf16_by_default(cuda, "no", _optimizer(stepped=True))  # state keyed by the fp32 weights
    assert not bf16_by_default(cuda, "no", _optimizer(torch.bfloat16))  # no fp32 weights to keep as masters


def test_ppo_trainer_on_the_cpu_writes_its_fp32_choice_back_into_the_config(tokenizer):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    config = PPOConfig(batch_size=2, mini_batch_size=1)
    assert config.bf16_weights is None
    with pytest.warns(UserWarning, match="No dataset"):
        trainer = PPOTrainer(config, model, None, tokenizer)
    assert trainer.config.bf16_weights is False and trainer._master is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
