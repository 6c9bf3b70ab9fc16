"""Training: GRPO-style RL on exact multi-turn token trajectories (``turnrl train CONFIG``; in
code, ``turnrl.app.train``, which wires a run from its config).

Importing this package imports torch; ``turnrl`` itself does not import it.
"""

from turnrl.train.advantages import ESTIMATORS, AdvantageOptions, compute_advantages, register_estimator
from turnrl.train.batch import Batch, TrainSample, build_samples, collate, micro_batches
from turnrl.train.config import TrainConfig, load_train_config
from turnrl.train.logprobs import token_logprobs
from turnrl.train.loss import POLICY_LOSSES, LossInputs, LossOptions, policy_loss, register_loss

__all__ = [
    "ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageOptions",
    "Batch",
    "LossInputs",
    "LossOptions",
    "TrainConfig",
    "TrainSample",
    "build_samples",
    "collate",
    "compute_advantages",
    "load_train_config",
    "micro_batches",
    "policy_loss",
    "register_estimator",
    "register_loss",
    "token_logprobs",
]
