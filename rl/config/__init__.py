"""Typed config schema (Hydra structured configs).

Dataclasses are the schema, YAML under ``conf/`` holds values. One module per config group
holds the group's base schema and one subclass per backend (``rollout.py``: ``hf``,
``sglang``; ``transfer.py``: ``ray``, ``mooncake``; ...), each ending with a ``SCHEMAS``
dict that this package registers with Hydra as ``schema/<group>/<key>``. This module holds
the root ``Config`` (cross-field checks), ``load`` and ``register_configs``.

Leaf checks live in each ``__post_init__``; a check that depends on the backend is a method
of the backend's schema (``RolloutConfig.check_cluster``) that the root calls, never a test
of ``name`` here. Both run when the entry point converts the composed config with ``load``,
before any worker starts. The ``transfer`` and ``weights`` schemas hold values only: the
code that checks, starts and builds their backends sits beside them in ``transfer/``, and
``rl.backends`` maps each schema to it.

A new backend of a group: a subclass in that group's module (or a module of its own beside
it, for a long one), one entry in its ``SCHEMAS``, and a YAML under ``conf/<group>/`` whose
``defaults`` start with ``/schema/<group>/<key>@_here_``; for ``transfer`` and ``weights``,
one entry in ``rl.backends`` too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from rl.config import algo, cluster, logger, model, rollout, task, transfer, weights
from rl.config.algo import IS_MASKS, KL_ESTIMATORS, LOSS_AGGS, AlgoConfig
from rl.config.checkpoint import CheckpointConfig
from rl.config.checks import parse_size, positive
from rl.config.eval import EvalConfig
from rl.config.cluster import ClusterConfig
from rl.config.logger import LoggerConfig
from rl.config.model import DTYPE_BYTES, ModelConfig, TinyModelConfig
from rl.config.rollout import HFRolloutConfig, RolloutConfig, SGLangRolloutConfig
from rl.config.task import (AdditionTaskConfig, JsonlTaskConfig, RepeatCountTaskConfig,
                            RepeatLetterTaskConfig, TaskConfig)
from rl.config.transfer import MooncakeTransferConfig, RayTransferConfig, TransferConfig
from rl.config.weights import BroadcastWeightsConfig, P2PWeightsConfig, WeightsConfig
from rl.log import LEVELS

__all__ = [
    "DTYPE_BYTES", "IS_MASKS", "KL_ESTIMATORS", "LOSS_AGGS", "AdditionTaskConfig", "AlgoConfig",
    "BroadcastWeightsConfig", "CheckpointConfig", "ClusterConfig", "Config", "EvalConfig", "HFRolloutConfig",
    "JsonlTaskConfig", "LoggerConfig", "ModelConfig", "MooncakeTransferConfig", "P2PWeightsConfig",
    "RayTransferConfig", "RepeatCountTaskConfig", "RepeatLetterTaskConfig", "RolloutConfig",
    "SGLangRolloutConfig", "TaskConfig", "TinyModelConfig", "TransferConfig", "WeightsConfig", "compose",
    "load", "parse_size", "register_configs"]


@dataclass(kw_only=True)
class Config:
    num_steps: int = 200
    """Training steps (one rollout batch and one optimizer step each)."""
    seed: int = 1
    """Seed of learners, engines and sampling."""
    run_name: Optional[str] = None
    """Run label for W&B and store keys; unset = derived from the time."""
    output_dir: Optional[str] = None
    """Where metrics, logs and checkpoints go; unset = Hydra's run directory."""
    log_level: str = "INFO"
    """Lowest level of the log lines every process prints (DEBUG, INFO, WARNING, ERROR)."""
    model: ModelConfig = MISSING
    rollout: RolloutConfig = MISSING
    transfer: TransferConfig = MISSING
    weights: WeightsConfig = MISSING
    algo: AlgoConfig = MISSING
    task: TaskConfig = MISSING
    cluster: ClusterConfig = MISSING
    logger: LoggerConfig = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        positive(self, "num_steps")
        if self.log_level not in LEVELS:
            raise ValueError(f"log_level={self.log_level!r} is not a level; use one of {', '.join(LEVELS)}")
        batch, learners = self.rollout.batch_size, self.cluster.num_learners
        if batch % learners:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.n_samples_per_prompt = {batch} samples "
                f"do not split evenly over cluster.num_learners={learners}; make it a multiple")
        if self.algo.steps_per_rollout > batch // learners:
            raise ValueError(
                f"algo.steps_per_rollout={self.algo.steps_per_rollout} exceeds the {batch // learners} "
                f"samples each of the cluster.num_learners={learners} ranks gets per rollout; every "
                f"mini-batch needs at least one sample per rank")
        budget, longest = self.algo.max_tokens_per_micro_batch, self.rollout.max_prompt_tokens + \
            self.rollout.max_new_tokens
        if budget and budget < longest:
            raise ValueError(
                f"algo.max_tokens_per_micro_batch={budget} cannot hold the longest possible sample, "
                f"rollout.max_prompt_tokens + rollout.max_new_tokens = {longest} tokens; raise it to "
                f"{longest} or more, or lower rollout.max_prompt_tokens (or rollout.max_new_tokens)")
        self.rollout.check_cluster(self.cluster)  # each engine kind knows what it needs
        self.rollout.check_model(self.model)
        self.task.check_rollout(self.rollout)  # and each task what its answers need
        self.task.check_algo(self.algo)

    def check_async(self) -> None:
        """What ``train_async.py`` needs beyond ``train.py`` (raised before any worker starts)."""
        if self.cluster.colocate:
            raise ValueError("train_async.py needs separate rollout and training pools (generation "
                             "overlaps training); cluster.colocate=true is supported by train.py only")
        if not self.rollout.fully_async and self.algo.max_staleness < 1:
            raise ValueError(f"algo.max_staleness={self.algo.max_staleness}: one-step off-policy "
                             f"trains every batch one version behind, so every sample would be "
                             f"dropped; use >= 1 or train.py")


_SCHEMAS: dict[str, dict[str, type]] = {
    "model": model.SCHEMAS, "rollout": rollout.SCHEMAS, "transfer": transfer.SCHEMAS,
    "weights": weights.SCHEMAS, "algo": algo.SCHEMAS, "task": task.SCHEMAS,
    "cluster": cluster.SCHEMAS, "logger": logger.SCHEMAS,
}
"""Group -> key -> schema, gathered from each group module's ``SCHEMAS``."""


def register_configs() -> None:
    """Register the root schema as ``schema`` and each group's schemas as ``schema/<group>/<name>``;
    the YAML files under ``conf/`` extend them."""
    # conf/config.yaml's hydra.run.dir: output_dir when set, else a new directory per run
    OmegaConf.register_new_resolver(
        "coalesce", lambda *values: next((v for v in values if v is not None), None), replace=True)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, schemas in _SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "conf")


def compose(*overrides: str) -> Config:
    """The typed config that ``python train.py <overrides>`` runs with, for tests and
    benchmarks (the entry points compose through ``@hydra.main``)."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return load(hydra_compose("config", overrides=list(overrides)))


def load(cfg: DictConfig) -> Config:
    """Composed Hydra config -> typed, validated, immutable-by-convention ``Config``."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config), type(obj)
    return obj
