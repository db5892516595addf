"""Rewards: learned and judged scorers (texts in, floats out) and verifiers with TRL 1.16's reward contract.

``rlhf_core.rewards`` is also this project's ``trl.rewards``: :func:`accuracy_reward`, :func:`reasoning_accuracy_reward`, :func:`think_format_reward`
and :func:`get_soft_overlong_punishment` keep TRL 1.16's names and signatures.

- :mod:`~rlhf_core.rewards.learned`: ``GoldJudge``, ``PipelineReward``, ``RewardModelScorer``, ``make_reward``.
- :mod:`~rlhf_core.rewards.answers`: finding a stated answer and comparing numbers exactly.
- :mod:`~rlhf_core.rewards.verifiers`: the verifier reward functions and one completion's ``Verdict``.
- :mod:`~rlhf_core.rewards.contract`: calling reward functions (sync or async, time-limited, failures isolated).
"""

from rlhf_core.rewards.answers import ANSWER_FORMATS, completion_text, extract_answer, gold_answer, parse_number
from rlhf_core.rewards.contract import RewardCall, call_reward_funcs, is_async
from rlhf_core.rewards.learned import GoldJudge, PipelineReward, RewardModelScorer, make_reward
from rlhf_core.rewards.verifiers import (
    AnswerFormatReward,
    SoftOverlongPunishment,
    Verdict,
    accuracy_reward,
    answer_format_reward,
    get_answer_format_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
    verify,
)

__all__ = ["ANSWER_FORMATS", "AnswerFormatReward", "GoldJudge", "PipelineReward", "RewardCall", "RewardModelScorer",
           "SoftOverlongPunishment", "Verdict", "accuracy_reward", "answer_format_reward", "call_reward_funcs",
           "completion_text", "extract_answer", "get_answer_format_reward", "get_soft_overlong_punishment",
           "gold_answer", "is_async", "make_reward", "parse_number", "reasoning_accuracy_reward", "think_format_reward",
           "verify"]
