"""The driver process: it starts the run's parts, drives each step and stops them.

``cluster`` starts Ray, the placement, the rollout manager and the learner ranks and stops
them; ``learners`` and ``rollout`` are the driver's handles on those actors; ``watchdog``
names a dependency that died; ``run`` holds the entry points' shared pieces (output
directory, resume, checkpoints, interrupts); ``metrics`` the sinks. The rollout side's code
is ``rl.rollout``, the learner's ``rl.learner``.
"""
