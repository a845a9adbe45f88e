"""What the three test tiers share: the environment every test process runs in (``env``),
processes and the test Ray (``procs``), the fixtures each tier's conftest picks
(``fixtures``), whole runs of train.py and train_async.py (``runs``), and the helpers that
several test files need. No test module imports another; what they share lives here."""
