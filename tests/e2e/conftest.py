"""The end-to-end tier: outcomes of whole runs. Learning curves (the reward rises), the
matrices of data paths and weight paths (the engines hold the learner's weights bit for bit;
under train_async.py every sample is trained once or counted as dropped), long fault and
resume runs (engines, a learner rank or the Mooncake master killed mid-run, Ctrl-C, a run
resumed from its checkpoint), and the two-node quickstart rehearsed in network namespaces
(marker ``two_node``: root, iproute2). ``make test-e2e`` runs it."""

from tests.support.fixtures import (chat_model_path, data_path, ray_local, shared_ray,  # noqa: F401
                                    test_deadline, tiny_path)
