"""`trl.trainer.ppo_trainer` of TRL 0.11: re-exports `rlhf_core.trainers.ppo.trainer`."""

from rlhf_core.trainers.ppo.trainer import *  # noqa: F401,F403

# Importable from here before the PPO forward moved into rlhf_core.trainers.forward (issue 23): kept, so no import
# that worked before breaks (tests/test_trl_compat.py).
from rlhf_core.trainers.forward import should_pack  # noqa: F401,E402
from rlhf_core.trainers.packing import pack_rows, unpack_slots  # noqa: F401,E402
