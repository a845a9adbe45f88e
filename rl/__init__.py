"""Application layer: config, RL algorithm, rollout engines and manager, learners."""
