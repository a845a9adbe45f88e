"""``rl.backends``: every schema of the two data paths has its builder there, the schemas hold
values and checks only, and the Mooncake protocol is the config's choice (an environment
variable fills in only a protocol the config leaves unset). No Ray, no master, no process."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

import rl.config.transfer as transfer_configs
import rl.config.weights as weights_configs
from rl import backends
from rl.backends import DATA_PATHS, WEIGHT_PATHS, data_path, weight_path
from rl.config import CONF_DIR, compose
from rl.config.transfer import MooncakeTransferConfig, TransferConfig
from rl.runtime import Runtime
from transfer.data.mooncake import MooncakeSettings, bootstrap

SERVICES = {"master_server_address": "10.0.0.1:50051", "metadata_server": "http://10.0.0.1:8080/metadata"}


@pytest.mark.parametrize("name", sorted(p.stem for p in Path(CONF_DIR, "transfer").glob("*.yaml")))
def test_every_transfer_choice_has_a_data_path(name):
    cfg = compose(f"transfer={name}").transfer
    assert isinstance(data_path(cfg), DATA_PATHS[type(cfg)])


@pytest.mark.parametrize("name", sorted(p.stem for p in Path(CONF_DIR, "weights").glob("*.yaml")))
def test_every_weights_choice_has_a_weight_path(name):
    cfg = compose(f"weights={name}").weights
    assert isinstance(weight_path(cfg), WEIGHT_PATHS[type(cfg)])


def test_every_registered_schema_has_a_builder():
    assert set(transfer_configs.SCHEMAS.values()) <= set(DATA_PATHS)
    assert set(weights_configs.SCHEMAS.values()) <= set(WEIGHT_PATHS)


def test_a_schema_without_a_builder_is_named():
    @dataclass(kw_only=True)
    class UnknownTransferConfig(TransferConfig):
        name: str = "unknown"

    with pytest.raises(ValueError, match="UnknownTransferConfig has no backend: add it to "
                                         "rl.backends.DATA_PATHS"):
        data_path(UnknownTransferConfig())

    @dataclass(kw_only=True)
    class TunedMooncake(MooncakeTransferConfig):  # a user's subclass keeps its parent's builder
        pass

    assert isinstance(data_path(TunedMooncake()), backends.MooncakeDataPath)


SCHEMAS = sorted({*transfer_configs.SCHEMAS.values(), *weights_configs.SCHEMAS.values()},
                 key=lambda s: s.__name__)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[s.__name__ for s in SCHEMAS])
def test_schemas_hold_values_and_checks_only(schema):
    """Fields, ``__post_init__`` checks and pure derived values; nothing that starts or builds."""
    derived = {"resolved_backend"}
    for klass in schema.__mro__:
        if klass.__module__.startswith("rl.config"):
            methods = {n for n, v in vars(klass).items() if inspect.isfunction(v)
                       and (not n.startswith("__") or n == "__post_init__")}
            assert methods <= {"__post_init__", *derived}, (klass.__name__, methods - {"__post_init__"})


def test_weight_plans_are_described_without_building_a_sender():
    class Engine:
        def __init__(self, name: str, num_ranks: int = 1) -> None:
            self.name, self.num_ranks = name, num_ranks

    engines = [Engine("e0"), Engine("e1"), Engine("e2")]
    broadcast, p2p = (weight_path(compose(f"weights={w}").weights) for w in ("broadcast", "p2p"))
    assert broadcast.describe_plan(2, engines) == "learner 0 -> e0, e1, e2"
    assert p2p.describe_plan(2, engines) == "learner 0 -> e0, e2; learner 1 -> e1"


# -- MOONCAKE_PROTOCOL fills in only what the config leaves unset ------------------------------
def client_settings(cfg: MooncakeTransferConfig, monkeypatch) -> MooncakeSettings:
    """The settings ``data_path(cfg).build`` opens its client with (in this process's
    environment), caught before any connection is made."""
    monkeypatch.setattr(backends, "open_store", lambda settings: settings)
    return data_path(cfg).build(Runtime("t", "/unused", "/unused", transfer=SERVICES))


def test_transfer_mooncake_tcp_stays_tcp_whatever_is_exported(monkeypatch):
    tcp = compose("transfer=mooncake_tcp").transfer
    assert tcp.protocol == "tcp"  # set by the YAML, not left to the environment
    for exported in ("rdma", "tcp", "nonsense"):
        monkeypatch.setenv("MOONCAKE_PROTOCOL", exported)
        assert client_settings(tcp, monkeypatch).protocol == "tcp"
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    # no RDMA device asked for: the driver's checks pass on a machine without one
    bootstrap.check_environment(num_nodes=1, local_hostname=None, protocol=tcp.protocol, device_name=None)
    assert bootstrap.describe_protocol(tcp.protocol, None) == \
        "protocol tcp (MOONCAKE_PROTOCOL=rdma ignored: the config sets it)"


def test_transfer_mooncake_rdma_stays_rdma_whatever_is_exported(monkeypatch):
    rdma = compose("transfer=mooncake_rdma", "transfer.device_name=mlx5_0").transfer
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    settings = client_settings(rdma, monkeypatch)
    assert (settings.protocol, settings.device_name) == ("rdma", "mlx5_0")


def test_the_variable_fills_in_an_unset_protocol(monkeypatch):
    unset = compose("transfer=mooncake_tcp", "transfer.protocol=null").transfer
    assert unset.protocol is None
    monkeypatch.delenv("MOONCAKE_PROTOCOL", raising=False)
    assert client_settings(unset, monkeypatch).protocol == "tcp"
    assert bootstrap.describe_protocol(None, None) == "protocol tcp (the default)"
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    assert client_settings(unset, monkeypatch).protocol == "rdma"
    assert bootstrap.describe_protocol(None, None) == "protocol rdma (MOONCAKE_PROTOCOL)"
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "ib")
    with pytest.raises(ValueError, match="MOONCAKE_PROTOCOL='ib': use tcp or rdma"):
        client_settings(unset, monkeypatch)


def test_a_bad_protocol_field_is_refused_when_the_config_loads():
    with pytest.raises(Exception, match="transfer.protocol='ib': use tcp or rdma"):
        compose("transfer=mooncake_tcp", "transfer.protocol=ib")
