"""Synchronous GRPO: generate -> train -> remove -> sync weights, one step at a time.

    python train.py                                      # tiny model on CPU: 2 engines, 2 learners
    python train.py transfer=mooncake_tcp weights=p2p    # choose each data path independently
    python train.py --help                               # the groups, their choices, the defaults' fields

The rollout batch never passes through this process: ``generate`` returns a small ref
(control plane), each learner rank fetches its own partition from the store (data plane).
"""

from __future__ import annotations

import atexit
import gc

import hydra
from omegaconf import DictConfig

from rl.config import load, register_configs
from rl.config.eval import eval_due
from rl.log import block_triton, setup_logging
from rl.driver.metrics import MetricsLogger
from rl.driver.run import (StepTimer, consuming, exit_on_interrupt, maybe_save, prepare_run, resume,
                    step_metrics)

register_configs()
atexit.register(gc.freeze)  # run last at exit: skip collecting every torch object (~0.8 s a run)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    cfg = load(dcfg)  # typed and validated: bad input fails here, before any worker starts
    block_triton()
    setup_logging(cfg.log_level)

    # imported here, not at the top (start-up cost): rl.driver.cluster loads Ray and the roles, about
    # 0.5 s that --help and a config error need not wait for
    from rl.driver.bounds import STOP_BOUND_S, exit_if_longer
    from rl.driver.cluster import Cluster

    runtime = prepare_run(cfg)
    logger = MetricsLogger(cfg, runtime)
    try:
        with Cluster(cfg, runtime, stop_bound_s=STOP_BOUND_S) as cluster:
            rollout, learners, store = cluster.rollout, cluster.learners, cluster.store
            start = resume(cfg, cluster)
            cluster.push_weights(version=start)  # engines serve exactly the learner's weights

            for step in range(start, cfg.num_steps):
                timer = StepTimer()
                with timer("rollout"), timer("wait_rollout"):
                    ref = rollout.generate(step)  # engines -> manager -> store; we get a ref
                with timer("train"), consuming(store, ref):  # removed after: consumed once
                    metrics = learners.train(ref)  # each rank gets its partition and trains
                with timer("update_weights"):
                    weights = cluster.push_weights(version=step + 1)
                m = step_metrics(step, ref, metrics, weights, timer)
                if eval_due(cfg, step + 1):  # the weights just pushed, on held-out prompts
                    m |= rollout.evaluate()
                logger.log(step, m)
                maybe_save(cfg, runtime, cluster, step + 1)
    finally:
        with exit_if_longer(STOP_BOUND_S):  # W&B's finish uploads, with no bound of its own
            logger.close()


if __name__ == "__main__":
    exit_on_interrupt(main)  # Ctrl-C: the run's parts stopped in order, exit status 130
