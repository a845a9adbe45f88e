"""The driver's part of a weight sync: the learners push, the rollout side frames the push.

``WeightPusher`` is set up once the learners and the engines are up: it writes the weight
plan, refuses names an engine's loader would drop (``check_names``), and has the learners
form the weight-update groups. Each ``push`` asks the rollout side to prepare the sync
(``EngineFleet.prepare_sync``: with fault tolerance, dead engines are replaced and the
learners connect the new ones), pushes, asks again after a push an engine died in and pushes
once more, and ends the sync. The first pushes are checked (``rl.driver.weight_checks``).
"""

from __future__ import annotations

import logging
import os
import time

from rl.backends import weight_path
from rl.config import Config
from rl.driver.learners import EngineUpdateFailed, LearnerGroup
from rl.driver.rollout import RolloutHandle
from rl.driver.weight_checks import CoverageCheck, check_names
from rl.log import first_line

logger = logging.getLogger(__name__)


class WeightPusher:
    def __init__(self, cfg: Config, learners: LearnerGroup, rollout: RolloutHandle, output_dir: str) -> None:
        self.cfg = cfg
        self.learners = learners
        self.rollout = rollout
        self.receivers = rollout.receivers()
        """Every engine as the weight path addresses it (updated when one is replaced)."""
        plan = weight_path(cfg.weights).describe_plan(cfg.cluster.num_learners, self.receivers)
        logger.info("%s plan: %s", cfg.weights.name, plan)
        with open(os.path.join(output_dir, "weights_plan.txt"), "w") as f:
            f.write(f"weights={cfg.weights.name}: {plan}\n")
        # before the first push: names an engine's loader would drop are refused here
        self.content_check = check_names(learners, self.receivers, cfg.model.dtype)
        self.coverage_check = CoverageCheck() if cfg.weights.check_coverage else None
        learners.connect_engines(self.receivers)

    def push(self, version: int) -> dict[str, float]:
        """The learners' weights to every engine, as ``version``. With fault tolerance the
        rollout side replaces the engines found dead first (a new engine on the same bundle,
        connected by the learners, given these weights, checked to serve ``version`` and only
        then put back into service), and again after a push an engine died in, which is then
        made again."""
        if self.coverage_check is not None:  # the first push, twice (rl.driver.weight_checks)
            check, self.coverage_check = self.coverage_check, None
            metrics = check.run(lambda: self._push(version), lambda: list(self.receivers))
        else:
            metrics = self._push(version)
        if self.content_check is not None:  # the first pushes are read back (rl.driver.weight_checks)
            self.content_check.after_push(self.learners, list(self.receivers), version)
        return metrics

    def _push(self, version: int) -> dict[str, float]:
        ok = False
        try:
            plan = self.rollout.prepare_sync()  # replacing engines may fail: the sync still ends
            restart_s = plan.restart_s
            while True:
                self.receivers = plan.receivers
                try:
                    if plan.replaced:  # their groups formed again: part of the replacement's time
                        t0 = time.perf_counter()
                        self.learners.reconnect_engines(plan.receivers, plan.replaced)
                        restart_s += time.perf_counter() - t0
                    metrics = self.learners.push_weights(version=version)
                    ok = True
                    break
                except EngineUpdateFailed as e:
                    plan = self.rollout.prepare_sync(unanswered=list(e.unanswered))
                    if not plan.replaced:
                        raise  # not an engine's death: the run's error
                    restart_s += plan.restart_s
                    logger.warning("the weight update to version %d failed (%s); %s replaced, "
                                   "pushing again", version, e,
                                   ", ".join(f"engine-{i}" for i in plan.replaced))
        finally:
            if ok:
                self.rollout.end_sync(ok)
            else:  # an error is on its way: ending the sync must not replace it
                try:
                    self.rollout.end_sync(ok)
                except Exception as e:
                    logger.warning("ending the weight sync failed: %s", first_line(e))
        if not self.cfg.rollout.fault_tolerance:
            return metrics
        return {**metrics, "rollout/engine_restarts": float(plan.restarts),
                "rollout/engine_restart_s": restart_s}
