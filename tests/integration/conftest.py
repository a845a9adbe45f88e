"""The integration tier: real parts, short runs. A local Ray (``ray_local``, or one
``ray start --head`` that a module's runs share: ``shared_ray``), CPU engines over HTTP, a
real mooncake_master (``data_path``), gloo process groups in spawned processes (``ranks``),
and ``train.py`` / ``train_async.py`` runs of a few steps that end as they should."""

from tests.support.fixtures import (chat_model_path, data_path, ranks, ray_local, shared_ray,  # noqa: F401
                                    test_deadline, tiny_path)
