"""Asynchronous GRPO: the engines generate while the learners train.

    python train_async.py                                   # one-step off-policy
    python train_async.py rollout.fully_async=true          # continuous generation, bounded queue
    python train_async.py transfer=mooncake_tcp weights=p2p algo.tis_cap=2.0   # same overrides as train.py

One-step off-policy: batch N+1 is generated while the learners train on batch N, so it is
sampled by weights one version behind the learner; weights are pushed once that generation
has finished, so an engine never serves half-updated weights.

Fully async: the engines stream groups (one prompt's answers each), and every
``rollout.prompts_per_step`` groups that finish form a batch, queued as store refs; a group
starts only if the store has room (``rollout.max_inflight_batches``) and it can be trained
within ``algo.max_staleness`` versions. A weight sync pauses the engines (requests in
flight wait) and continues them. Samples that still end up too stale are dropped and
counted; ``samples.jsonl`` records what became of every generated sample.

Either way ``algo.tis_cap`` reweights stale tokens by the truncated importance ratio
against the engines' log-probs, and ``algo.is_mask`` can mask them out (docs/algo.md).
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
from rl.driver.run import (StepTimer, checkpoint_due, consuming, exit_on_interrupt, maybe_save, prepare_run,
                    resume, step_metrics, write_sample_ledger)

register_configs()
atexit.register(gc.freeze)  # run last at exit: skip collecting every torch object (~0.8 s a run)


def one_step_off_policy(cfg, cluster, logger, runtime) -> None:
    rollout, learners, store = cluster.rollout, cluster.learners, cluster.store
    start = resume(cfg, cluster)
    cluster.push_weights(version=start)
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
                weights = cluster.push_weights(version=step + 1)
            m = step_metrics(step, ref, metrics, weights, timer)
            if eval_due(cfg, step + 1):  # version step + 1; the next batch is generated already
                m |= rollout.evaluate()
            logger.log(step, m)
            maybe_save(cfg, runtime, cluster, step + 1, rollout_state=position)
    finally:
        rollout.discard(pending, store)  # no key outlives the run


def fully_async(cfg, cluster, logger, runtime) -> None:
    rollout, learners, store = cluster.rollout, cluster.learners, cluster.store
    start = resume(cfg, cluster)
    cluster.push_weights(version=start)
    rollout.start_stream(first_step=start)
    try:
        for step in range(start, cfg.num_steps):
            timer = StepTimer()
            with timer("wait_rollout"):
                ref = rollout.next_batch(step)  # samples older than max_staleness: dropped
            with timer("train"), consuming(store, ref):
                metrics = learners.train(ref)
            with timer("update_weights"), rollout.paused():  # no forward pass mid-update
                weights = cluster.push_weights(version=step + 1)
            rollout.release(ref, step)  # version moves on: the next groups are admitted
            m = step_metrics(step, ref, metrics, weights, timer)
            if eval_due(cfg, step + 1):  # version step + 1 (no sync runs meanwhile), beside the stream
                m |= rollout.evaluate()
            logger.log(step, m)
            if checkpoint_due(cfg, step + 1):  # queued batches are generated again on resume
                maybe_save(cfg, runtime, cluster, step + 1, rollout_state=rollout.resume_position())
    finally:
        # the ledger is written even when a death is found meanwhile: no interrupt cuts it
        # short, and a known death bounds the wait as it bounds the shutdown's
        died = cluster.stop_watching()
        write_sample_ledger(runtime, rollout.stop_stream(timeout_s=10 if died else None))


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    cfg = load(dcfg)  # typed and validated: bad input fails here, before any worker starts
    block_triton()
    setup_logging(cfg.log_level)
    cfg.check_async()

    # imported here, not at the top (start-up cost): rl.driver.cluster loads Ray and the roles, about
    # 0.5 s that --help and a config error need not wait for
    from rl.driver.bounds import STOP_BOUND_S, exit_if_longer
    from rl.driver.cluster import Cluster

    runtime = prepare_run(cfg)
    logger = MetricsLogger(cfg, runtime)
    held = cfg.rollout.max_inflight_batches if cfg.rollout.fully_async else 2
    try:
        with Cluster(cfg, runtime, batches_held=held, stop_bound_s=STOP_BOUND_S) as cluster:
            loop = fully_async if cfg.rollout.fully_async else one_step_off_policy
            loop(cfg, cluster, logger, runtime)
    finally:
        with exit_if_longer(STOP_BOUND_S):  # W&B's finish uploads, with no bound of its own
            logger.close()


if __name__ == "__main__":
    exit_on_interrupt(main)  # Ctrl-C: the run's parts stopped in order, exit status 130
