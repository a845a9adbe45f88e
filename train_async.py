"""One-step off-policy GRPO: the engines generate batch N+1 while the learners train on N.

    python train_async.py                                   # same overrides as train.py
    python train_async.py transfer=mooncake_tcp weights=p2p algo.tis_cap=2.0

Batch N+1 is sampled by the weights of step N-1's update (one version behind the learner
that trains on it); ``algo.tis_cap`` reweights its tokens by the truncated importance
ratio against the engines' log-probs. Weights are pushed only once the overlapping
generation has finished, so an engine never serves half-updated weights.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from rl.config import load, register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    cfg = load(dcfg)  # typed and validated: bad input fails here, before any worker starts

    from rl.cluster import Cluster
    from rl.metrics import MetricsLogger
    from rl.run import (StepTimer, checkpoint_due, consuming, maybe_save, prepare_run, resume,
                        step_metrics)

    runtime = prepare_run(cfg)
    logger = MetricsLogger(cfg, runtime)
    try:
        with Cluster(cfg, runtime) as cluster:
            rollout, learners, store = cluster.rollout, cluster.learners, cluster.store
            start = resume(cfg, cluster)
            learners.push_weights(version=start)
            pending = rollout.generate_async(start)

            try:
                for step in range(start, cfg.num_steps):
                    timer = StepTimer()
                    with timer("wait_rollout"):
                        ref = rollout.wait(pending)  # the learners idle only here
                    # a checkpoint after this step resumes at batch step + 1: record the data
                    # position before that batch is drawn
                    position = rollout.state_dict() if checkpoint_due(cfg, step + 1) else None
                    # the next batch starts now, on the engines, while the learners train
                    pending = rollout.generate_async(step + 1) if step + 1 < cfg.num_steps else None
                    with timer("train"), consuming(store, ref):
                        metrics = learners.train(ref)
                    with timer("wait_rollout"):
                        rollout.wait_idle(pending)  # never swap weights under a running generation
                    with timer("update_weights"):
                        weights = learners.push_weights(version=step + 1)
                    logger.log(step, step_metrics(step, ref, metrics, weights, timer))
                    maybe_save(cfg, runtime, cluster, step + 1, rollout_state=position)
            finally:
                rollout.discard(pending, store)  # no key outlives the run
    finally:
        logger.close()


if __name__ == "__main__":
    main()
