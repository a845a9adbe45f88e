"""``transfer=mooncake_tcp`` / ``mooncake_rdma``: rollout data through Mooncake Store.

* ``client``: what every store shares (settings and their checks, the connection, errors);
  it knows no codec.
* ``packed`` (``MooncakeStore``, ours; ``MooncakePickleStore``, the pickled dict over the same
  path) and ``bundle`` (``MooncakeBundleStore``, Mooncake's own ``MooncakeBundleTransfer``,
  the reference): the codecs, subclasses of the client.
* ``bootstrap``: the driver's checks and services before any worker starts, and each
  client's settings from plain values.
* ``master``: start and stop a ``mooncake_master``; by hand with
  ``python -m transfer.data.mooncake.master --host <ip>``.

``open_store(settings)`` builds the store of ``settings.codec``. Nothing here imports
``bootstrap`` or ``master`` (so ``python -m`` runs ``master`` once, as ``__main__``).
"""

from __future__ import annotations

from transfer.data.base import RolloutStore
from transfer.data.mooncake.bundle import MooncakeBundleStore
from transfer.data.mooncake.client import (MooncakeClient, MooncakeSettings, StoreError,
                                           StoreRemovedError)
from transfer.data.mooncake.packed import MooncakePickleStore, MooncakeStore

__all__ = ["CODECS", "MooncakeBundleStore", "MooncakeClient", "MooncakeSettings", "MooncakePickleStore",
           "MooncakeStore", "StoreError", "StoreRemovedError", "open_store"]

CODECS: dict[str, type[MooncakeClient]] = {"packed": MooncakeStore, "pickle": MooncakePickleStore,
                                           "bundle": MooncakeBundleStore}
"""``transfer.codec`` -> the store class that implements it."""


def open_store(settings: MooncakeSettings) -> RolloutStore:
    """A connected store client for ``settings.codec``."""
    if settings.codec not in CODECS:
        raise ValueError(f"unknown Mooncake codec {settings.codec!r}; use {' or '.join(CODECS)}")
    return CODECS[settings.codec](settings)
