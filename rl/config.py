"""Typed config schema (Hydra structured configs).

Dataclasses are the schema, YAML under ``conf/`` holds values. Leaf checks live in each
``__post_init__``, cross-field checks in ``Config.__post_init__``; both run when the
entry point converts the composed config with ``load`` (before any worker starts). Each
config group's dataclass builds its own backend and imports heavy dependencies lazily.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

if TYPE_CHECKING:
    from rl.runtime import Runtime
    from transfer.data.base import RolloutStore
    from transfer.weights.base import WeightSync

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.I)
_UNITS = {None: 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: Any, field_name: str) -> int:
    """``"512mb"``/``"2gb"``/``1048576`` -> bytes (binary units). Raises a ValueError naming the field."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name}={value!r} is not a size; use bytes or e.g. '512mb', '2gb'")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ValueError(f"{field_name}={value!r} is not a size; use bytes or e.g. '512mb', '2gb'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower() if m.group(2) else None])
    if n < 0:
        raise ValueError(f"{field_name}={value!r} must not be negative")
    return n


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ValueError(f"{_prefix(obj)}{name}={value} must be > 0")


def _prefix(obj: Any) -> str:
    return getattr(obj, "_group", "") and f"{obj._group}."


# ---------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TinyModelConfig:
    """Architecture of the built-in tiny Qwen2 model (used when ``model.path`` is unset)."""

    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 256
    """Width of the MLP."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    max_positions: int = 128
    """Longest sequence (prompt + response) in tokens."""
    init_seed: int = 0
    """Seed of the initial weights; same seed, same weights, same cache entry."""

    def __post_init__(self) -> None:
        _positive(self, "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "max_positions")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny: hidden_size must divide by num_heads and num_heads "
                             "by num_kv_heads")


@dataclass(kw_only=True)
class ModelConfig:
    _group = "model"
    name: str = "tiny"
    """Label of this model choice (shown in logs and W&B)."""
    path: Optional[str] = None
    """Hugging Face checkpoint directory; unset = the built-in tiny model, built and cached in code."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Architecture of the tiny model (ignored when ``path`` is set)."""
    dtype: str = "float32"
    """Parameter dtype of the learners and of the engines, which sample in it (float32,
    bfloat16, float16; passed to each engine as ``--dtype``)."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (for instruction-tuned checkpoints)."""

    def __post_init__(self) -> None:
        if self.path is not None:
            path = os.path.expanduser(self.path)
            if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
                raise ValueError(f"model.path={self.path!r} is not a Hugging Face checkpoint "
                                 "directory (no config.json there); pass a local path, models "
                                 "are never downloaded at run time")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")


# ---------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class RolloutConfig:
    _group = "rollout"
    name: str = MISSING
    """Engine kind: ``hf`` (CPU engine) or ``sglang``."""
    prompts_per_step: int = 32
    """Prompts drawn per training step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the GRPO group size)."""
    max_new_tokens: int = 8
    """Longest response in tokens."""
    max_prompt_tokens: int = 1024
    """Longest prompt in tokens (a longer one is an error); also sizes store capacity checks."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are of the tempered distribution, on both sides)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    request_timeout_s: float = 300.0
    """Bound on one generate request."""
    engine_start_timeout_s: float = 180.0
    """Bound on an engine becoming healthy; its log tail is reported when exceeded."""
    health_check_timeout_s: float = 30.0
    """Bound on one ``/health`` answer (SGLang answers 503 while loading, and may run a
    one-token generation and sleep 1 s before answering 200)."""
    fully_async: bool = False
    """``train_async.py`` only: engines generate continuously into a bounded queue instead of
    one batch ahead (weight syncs pause and continue them)."""
    max_inflight_batches: int = 2
    """Fully async: batches generated or being generated and not yet trained on; it bounds
    the batches held in the store, and a sample's staleness to this minus one."""
    pause_mode: str = "retract"
    """How engines pause for a weight sync (SGLang's ``pause_generation`` mode): ``retract``
    or ``in_place``; requests in flight are kept either way."""

    def __post_init__(self) -> None:
        _positive(self, "prompts_per_step", "n_samples_per_prompt", "max_new_tokens", "max_prompt_tokens",
                  "request_timeout_s", "engine_start_timeout_s", "health_check_timeout_s")
        if self.max_inflight_batches < 1:
            raise ValueError(f"rollout.max_inflight_batches={self.max_inflight_batches}: the queue "
                             f"needs room for at least 1 batch (2 or more lets generation overlap training)")
        if self.pause_mode not in ("retract", "in_place"):
            raise ValueError(f"rollout.pause_mode={self.pause_mode!r}: use 'retract' or 'in_place' "
                             f"('abort' would end the requests in flight)")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.n_samples_per_prompt

    def sampling_params(self) -> dict:
        """The ``sampling_params`` of every generate request (SGLang's field names)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k}

    def server_command(self, model_path: str, host: str, port: int, index: int,
                       seed: int, gpus: int, dtype: str = "float32") -> list[str]:
        """The command that starts engine ``index`` (an HTTP server on ``host:port``).
        ``dtype``: the engine's weight and compute dtype, ``model.dtype`` (the learner's), so
        that the engines sample with the weights the learner trains, bit for bit."""
        raise NotImplementedError


@dataclass(kw_only=True)
class HFRolloutConfig(RolloutConfig):
    name: str = "hf"
    max_batch_size: int = 256
    """Most requests the CPU engine decodes together."""
    batch_wait_ms: float = 5.0
    """How long the engine waits for more requests before starting a batch."""
    device: str = "cpu"
    """Device of the CPU engine's model (``cpu``; ``cuda`` works where available)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "max_batch_size")

    def server_command(self, model_path: str, host: str, port: int, index: int,
                       seed: int, gpus: int, dtype: str = "float32") -> list[str]:
        import sys

        return [sys.executable, "-m", "rl.rollout.engines.hf_server", "--model-path", model_path,
                "--host", host, "--port", str(port), "--seed", str(seed + 1000 * index),
                "--max-batch-size", str(self.max_batch_size),
                "--batch-wait-ms", str(self.batch_wait_ms), "--device", self.device,
                "--dtype", dtype]


@dataclass(kw_only=True)
class SGLangRolloutConfig(RolloutConfig):
    name: str = "sglang"
    engine_start_timeout_s: float = 900.0
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory SGLang takes for weights and KV cache."""
    extra_args: list[str] = field(default_factory=list)
    """Further ``sglang.launch_server`` arguments, passed through as given."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"rollout.mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if any(str(a) == "--dtype" or str(a).startswith("--dtype=") for a in self.extra_args):
            raise ValueError("rollout.extra_args: --dtype is set from model.dtype (the engines "
                             "sample in the learner's dtype); set model.dtype instead")

    def server_command(self, model_path: str, host: str, port: int, index: int,
                       seed: int, gpus: int, dtype: str = "float32") -> list[str]:
        import sys

        # SGLang is imported nowhere in this project: it only runs in the engine process.
        # --dtype: SGLang 0.5.23 accepts float32, bfloat16 and float16 as model.dtype spells
        # them; its default (auto) would run a float32 checkpoint in float16.
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
                "--host", host, "--port", str(port), "--tp-size", str(gpus),
                "--mem-fraction-static", str(self.mem_fraction_static),
                "--random-seed", str(seed + 1000 * index), "--dtype", dtype, *self.extra_args]


# ---------------------------------------------------------------------------------------
# transfer (rollout data path)
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TransferConfig:
    _group = "transfer"
    name: str = MISSING
    """Backend of the rollout-data path."""

    def start_services(self, runtime: "Runtime", num_nodes: int, bytes_per_step: int,
                       batches_held: int = 1) -> tuple[dict[str, str], Optional[Callable[[], None]]]:
        """Driver side, before any worker starts: check the environment, start what the
        backend needs (a local master). ``batches_held``: rollout batches the store holds at
        once (1 for train.py, more when generation runs ahead). Returns settings for
        ``runtime.transfer`` and a stop function."""
        return {}, None

    def build(self, runtime: "Runtime", *, contribute_segment: bool = False) -> "RolloutStore":
        """A store client for this process; ``contribute_segment``: it lends memory to the
        store (learner local rank 0 only)."""
        raise NotImplementedError


@dataclass(kw_only=True)
class RayTransferConfig(TransferConfig):
    name: str = "ray"

    def build(self, runtime: "Runtime", *, contribute_segment: bool = False) -> "RolloutStore":
        from transfer.data.ray_store import RayStore

        return RayStore()


@dataclass(kw_only=True)
class MooncakeTransferConfig(TransferConfig):
    name: str = "mooncake_tcp"
    master_server_address: Optional[str] = None
    """Mooncake master ``host:port``; unset = env MOONCAKE_MASTER, else a local master is started
    (single machine only)."""
    metadata_server: Optional[str] = None
    """HTTP metadata server URL; unset = env MOONCAKE_METADATA_SERVER, else
    ``http://<master host>:8080/metadata`` (the master's built-in one)."""
    local_hostname: Optional[str] = None
    """Address this client is reached at; unset = env MOONCAKE_LOCAL_HOSTNAME, else the Ray node IP."""
    protocol: Optional[str] = None
    """``tcp`` or ``rdma``; unset = env MOONCAKE_PROTOCOL, else tcp."""
    device_name: Optional[str] = None
    """RDMA device(s), e.g. ``mlx5_0``; unset = env MOONCAKE_DEVICE (read on each node)."""
    global_segment_size: Any = "1gb"
    """Memory each contributing client (learner local rank 0) lends to the store."""
    local_buffer_size: Any = "64mb"
    """Client-side transfer buffer of every client."""
    chunk_bytes: Any = "4mb"
    """Largest single object; payloads are split into chunks of this size."""
    replica_num: int = 1
    """Copies of every object (on different segments)."""
    codec: str = "packed"
    """``packed`` (ours: one registered buffer, chunked) or ``bundle`` (MooncakeBundleTransfer)."""
    init_kwargs: Any = None
    """Extra client ``setup`` keys, a mapping or a JSON string; they win over the fields above."""
    master_start_timeout_s: float = 15.0
    """Bound on a locally started master becoming ready."""

    def __post_init__(self) -> None:
        for f in ("global_segment_size", "local_buffer_size", "chunk_bytes"):
            setattr(self, f, parse_size(getattr(self, f), f"transfer.{f}"))
        if self.chunk_bytes <= 0:
            raise ValueError("transfer.chunk_bytes must be > 0")
        if self.global_segment_size < 16 << 20:  # Mooncake refuses smaller segments
            raise ValueError(f"transfer.global_segment_size={self.global_segment_size} bytes is "
                             "below Mooncake's minimum of 16mb")
        if self.protocol is not None and self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"transfer.protocol={self.protocol!r}: use tcp or rdma")
        if self.codec not in ("packed", "bundle"):
            raise ValueError(f"transfer.codec={self.codec!r}: use packed or bundle")
        if self.replica_num < 1:
            raise ValueError(f"transfer.replica_num={self.replica_num} must be >= 1")
        self.init_kwargs = _parse_init_kwargs(self.init_kwargs)

    def resolved_protocol(self) -> str:
        proto = self.protocol or os.environ.get("MOONCAKE_PROTOCOL") or "tcp"
        if proto not in ("tcp", "rdma"):
            raise ValueError(f"MOONCAKE_PROTOCOL={proto!r}: use tcp or rdma")
        return proto

    def start_services(self, runtime: "Runtime", num_nodes: int, bytes_per_step: int,
                       batches_held: int = 1) -> tuple[dict[str, str], Optional[Callable[[], None]]]:
        from transfer.data.mooncake_store import import_mooncake

        import_mooncake()  # a missing or wrong wheel is reported here, before workers start
        proto = self.resolved_protocol()
        device = self.device_name or os.environ.get("MOONCAKE_DEVICE")
        if proto == "rdma":
            if not device:
                raise ValueError("transfer protocol rdma needs a device: set transfer.device_name "
                                 "(e.g. mlx5_0) or export MOONCAKE_DEVICE on every node before "
                                 "`ray start`; or use transfer=mooncake_tcp")
            if num_nodes == 1 and not _rdma_devices():
                raise ValueError(f"transfer protocol rdma: this machine has no RDMA device "
                                 f"(/sys/class/infiniband is empty), {device!r} cannot work; "
                                 "use transfer=mooncake_tcp")
        host = self.local_hostname or os.environ.get("MOONCAKE_LOCAL_HOSTNAME")
        if num_nodes > 1 and host and _is_loopback(host):
            raise ValueError(f"transfer.local_hostname={host!r} is a loopback address but the Ray "
                             f"cluster has {num_nodes} nodes: other nodes cannot reach it; unset it "
                             "(the Ray node IP is used) or give this node's routable address")
        need = bytes_per_step * batches_held * self.replica_num
        if self.global_segment_size < need:
            held = "one step's rollout batch" if batches_held == 1 else \
                f"{batches_held} rollout batches held at once (generation runs ahead)"
            raise ValueError(f"transfer.global_segment_size={self.global_segment_size} bytes is too "
                             f"small: {held} need about {need} bytes ({self.replica_num} "
                             f"replica(s)); set transfer.global_segment_size={_human(need * 2)} or more")
        master = self.master_server_address or os.environ.get("MOONCAKE_MASTER")
        if master:
            metadata = (self.metadata_server or os.environ.get("MOONCAKE_METADATA_SERVER")
                        or f"http://{master.rpartition(':')[0]}:8080/metadata")
            return {"master_server_address": master, "metadata_server": metadata}, None
        if num_nodes > 1:
            raise ValueError(
                f"transfer=mooncake_*: no master address and the Ray cluster has {num_nodes} "
                "nodes. Start a master on one node: python -m transfer.data.mooncake_master "
                "--host <that node's IP>, then export MOONCAKE_MASTER=<ip>:50051 and "
                "MOONCAKE_METADATA_SERVER=http://<ip>:8080/metadata on every node before `ray start`")
        from transfer.data.mooncake_master import MooncakeMaster

        m = MooncakeMaster("127.0.0.1", log_path=os.path.join(runtime.log_dir, "mooncake_master.log"))
        m.start(timeout_s=self.master_start_timeout_s)
        print(f"[mooncake] started a local master (pid {m.proc.pid}) at {m.address}; "
              f"log {m.log_path}", flush=True)
        return {"master_server_address": m.address, "metadata_server": m.metadata_server,
                "admin_url": m.admin_url, "master_pid": str(m.proc.pid)}, m.stop

    def build(self, runtime: "Runtime", *, contribute_segment: bool = False) -> "RolloutStore":
        from rl.runtime import node_ip
        from transfer.data.mooncake_store import MooncakeSettings, MooncakeStore

        if "master_server_address" not in runtime.transfer:
            raise RuntimeError("the Mooncake master is not resolved: start_services() runs first")
        settings = MooncakeSettings(
            master_server_address=runtime.transfer["master_server_address"],
            metadata_server=runtime.transfer["metadata_server"],
            local_hostname=(self.local_hostname or os.environ.get("MOONCAKE_LOCAL_HOSTNAME")
                            or node_ip()),
            protocol=self.resolved_protocol(),
            device_name=self.device_name or os.environ.get("MOONCAKE_DEVICE", ""),
            global_segment_size=self.global_segment_size if contribute_segment else 0,
            local_buffer_size=self.local_buffer_size, chunk_bytes=self.chunk_bytes,
            replica_num=self.replica_num, codec=self.codec, init_kwargs=dict(self.init_kwargs))
        return MooncakeStore(settings)


def _parse_init_kwargs(value: Any) -> dict[str, Any]:
    from transfer.data.mooncake_store import SETUP_KEYS

    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"transfer.init_kwargs is not valid JSON ({e}): {value!r}") from None
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value)
    if not isinstance(value, dict):
        raise ValueError(f"transfer.init_kwargs must be a mapping or a JSON object, got {value!r}")
    unknown = sorted(set(value) - SETUP_KEYS)
    if unknown:
        raise ValueError(f"transfer.init_kwargs: unknown Mooncake setup keys {unknown}; "
                         f"known: {sorted(SETUP_KEYS)}")
    out = dict(value)
    for k in ("global_segment_size", "local_buffer_size"):
        if k in out:
            out[k] = parse_size(out[k], f"transfer.init_kwargs.{k}")
    for k in ("enable_ssd_offload", "enable_client_http_server"):
        if k in out and not isinstance(out[k], bool):
            raise ValueError(f"transfer.init_kwargs.{k}={out[k]!r} must be true or false")
    if "client_http_port" in out and (isinstance(out["client_http_port"], bool)
                                      or not isinstance(out["client_http_port"], int)):
        raise ValueError(f"transfer.init_kwargs.client_http_port={out['client_http_port']!r} "
                         "must be an integer")
    return out


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _human(n: int) -> str:
    for unit, size in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if n >= size:
            return f"{-(-n // size)}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------
# weights (weight path)
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class WeightsConfig:
    _group = "weights"
    name: str = MISSING
    """Weight path to the engines."""
    bucket_bytes: Any = "512mb"
    """Largest bucket per update call, in bytes or as '512mb'."""
    backend: str = "auto"
    """Side-group backend: ``gloo``, ``nccl``, or ``auto`` (nccl when learners use GPUs)."""
    timeout_s: float = 120.0
    """Bound on every group operation and engine call of a sync."""

    def __post_init__(self) -> None:
        self.bucket_bytes = parse_size(self.bucket_bytes, "weights.bucket_bytes")
        if self.bucket_bytes <= 0:
            raise ValueError("weights.bucket_bytes must be > 0")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"weights.backend={self.backend!r}: use auto, gloo or nccl")
        _positive(self, "timeout_s")

    def describe_plan(self, num_learners: int, receivers: list) -> str:
        """Which learner rank sends to which engine (printed at start, saved in the run dir)."""
        return "learner 0 -> " + ", ".join(r.name for r in receivers)

    def resolved_backend(self, on_gpu: bool) -> str:
        return ("nccl" if on_gpu else "gloo") if self.backend == "auto" else self.backend

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        raise NotImplementedError


@dataclass(kw_only=True)
class BroadcastWeightsConfig(WeightsConfig):
    name: str = "broadcast"

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        from transfer.weights.broadcast import BroadcastSync

        return BroadcastSync(rank=rank, master_address=master_address,
                             bucket_bytes=self.bucket_bytes,
                             backend=self.resolved_backend(on_gpu), timeout_s=self.timeout_s,
                             device=device)


@dataclass(kw_only=True)
class P2PWeightsConfig(WeightsConfig):
    name: str = "p2p"

    def describe_plan(self, num_learners: int, receivers: list) -> str:
        from transfer.weights.p2p import format_plan, plan_p2p

        return format_plan(plan_p2p(num_learners, receivers), receivers)

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        from transfer.weights.p2p import P2PSync

        return P2PSync(rank=rank, world_size=world_size, master_address=master_address,
                       bucket_bytes=self.bucket_bytes, backend=self.resolved_backend(on_gpu),
                       timeout_s=self.timeout_s, device=device)


# ---------------------------------------------------------------------------------------
# algo
# ---------------------------------------------------------------------------------------
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""``algo.loss_agg`` choices (implemented in ``rl.algo``; listed here so that validating a
config does not import torch)."""
KL_ESTIMATORS = ("k1", "k3")
"""``algo.kl_estimator`` choices."""


@dataclass(kw_only=True)
class AlgoConfig:
    _group = "algo"
    name: str = "grpo"
    """Algorithm label."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2 (0.999 got stuck on the tiny task in some seeds)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_schedule: str = "constant"
    """``constant`` or ``cosine`` decay to ``min_lr_ratio * lr`` at ``num_steps``."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule, as a fraction of ``lr``."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    clip_eps: float = 0.2
    """PPO ratio clip range (lower side, and upper side unless ``clip_eps_high`` is set)."""
    clip_eps_high: Optional[float] = None
    """Upper clip range (DAPO's clip-higher); unset = ``clip_eps``."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the initial (reference) policy (estimator: ``kl_estimator``);
    0 = no reference model."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    micro_batch_size: int = 64
    """Samples per forward/backward pass on one learner rank."""
    advantage_std_norm: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO)."""
    tis_cap: float = 0.0
    """Truncated importance sampling against the engines' log-probs: each token's loss is
    weighted by min(exp(logp_learner - logp_engine), tis_cap); 0 = off."""
    max_staleness: int = 1
    """``train_async.py``: a sample generated by weights more than this many versions older
    than the ones being trained is dropped (and counted in ``async/dropped_samples``)."""
    steps_per_rollout: int = 1
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches
    (the same number on every rank); the clip works against the log-probs of the weights
    the rollout's step started from."""
    loss_agg: str = "token_mean"
    """How token losses become one loss: ``token_mean`` (over all loss tokens of a
    mini-batch), ``seq_mean_token_mean`` (mean of per-sequence means) or
    ``seq_mean_token_sum_norm`` (Dr. GRPO: token sum / (sequences * rollout.max_new_tokens))."""
    kl_estimator: str = "k3"
    """Estimator of the KL penalty to the reference policy (with ``kl_coef`` > 0): ``k1``
    (logp - ref_logp) or ``k3`` (low-variance, always >= 0)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (``train/entropy`` is logged either way); 0 = off."""
    drop_zero_std_groups: bool = False
    """Take groups whose rewards are all equal out of the loss (they carry no policy
    gradient, only dilute its normalisation); counted in ``rollout/zero_std_groups`` either way."""

    def __post_init__(self) -> None:
        _positive(self, "lr", "micro_batch_size", "grad_clip", "steps_per_rollout")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"algo.loss_agg={self.loss_agg!r}: use one of {', '.join(LOSS_AGGS)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algo.kl_estimator={self.kl_estimator!r}: use one of "
                             f"{', '.join(KL_ESTIMATORS)}")
        if self.entropy_coef < 0:
            raise ValueError(f"algo.entropy_coef={self.entropy_coef} must be >= 0 (0 = off)")
        if self.clip_eps <= 0 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise ValueError("algo.clip_eps and algo.clip_eps_high must be > 0")
        if self.tis_cap < 0:
            raise ValueError(f"algo.tis_cap={self.tis_cap} must be >= 0 (0 = off)")
        if self.max_staleness < 0:
            raise ValueError(f"algo.max_staleness={self.max_staleness} must be >= 0 (versions a "
                             f"sample's weights may lag the trained ones)")
        if self.kl_coef < 0:
            raise ValueError(f"algo.kl_coef={self.kl_coef} must be >= 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"algo.lr_schedule={self.lr_schedule!r}: use constant or cosine")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"algo.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


# ---------------------------------------------------------------------------------------
# task
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TaskConfig:
    _group = "task"
    name: str = MISSING
    """Task label."""
    seed: int = 0
    """Seed of the prompt stream."""

    def build(self):  # -> rl.tasks.Task
        raise NotImplementedError


@dataclass(kw_only=True)
class RepeatLetterTaskConfig(TaskConfig):
    name: str = "repeat_letter"
    repeat: int = 4
    """How many times the letter must be repeated (``c:`` -> ``cccc``)."""

    def __post_init__(self) -> None:
        _positive(self, "repeat")

    def build(self):
        from rl.tasks.builtin import RepeatLetterTask

        return RepeatLetterTask(repeat=self.repeat, seed=self.seed)


@dataclass(kw_only=True)
class AdditionTaskConfig(TaskConfig):
    name: str = "addition"
    max_value: int = 99
    """Largest operand."""

    def __post_init__(self) -> None:
        _positive(self, "max_value")

    def build(self):
        from rl.tasks.builtin import AdditionTask

        return AdditionTask(max_value=self.max_value, seed=self.seed)


@dataclass(kw_only=True)
class JsonlTaskConfig(TaskConfig):
    name: str = "jsonl"
    path: str = MISSING
    """JSONL file of ``{"prompt": ..., "label": ...}`` lines."""
    reward: Any = field(default_factory=lambda: {"_target_": "rl.tasks.rewards.exact_match"})
    """Reward function: ``{_target_: module.function, **kwargs}``, called as f(response, label, **kwargs)."""

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.expanduser(self.path)):
            raise ValueError(f"task.path={self.path!r} does not exist (a JSONL file of "
                             '{"prompt": ..., "label": ...} lines)')
        reward = dict(self.reward) if isinstance(self.reward, (dict, DictConfig)) else None
        if not reward or "_target_" not in reward:
            raise ValueError("task.reward needs a '_target_' naming a function, e.g. "
                             "{_target_: rl.tasks.rewards.exact_match}")
        module, _, fn = str(reward["_target_"]).rpartition(".")
        try:
            getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"task.reward._target_={reward['_target_']!r} cannot be imported: {e}")
        self.reward = reward

    def build(self):
        from rl.tasks.jsonl import JsonlTask

        return JsonlTask(path=os.path.expanduser(self.path), reward=self.reward, seed=self.seed)


# ---------------------------------------------------------------------------------------
# cluster, logger, checkpoint
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ClusterConfig:
    _group = "cluster"
    name: str = "local"
    """Placement label."""
    address: Optional[str] = None
    """Ray cluster to join (``auto`` or host:port); unset = start a local Ray."""
    num_engines: int = 2
    """Rollout engine processes."""
    num_learners: int = 2
    """Learner ranks (FSDP2 data-parallel world)."""
    gpus_per_engine: int = 0
    """GPUs per engine (its tensor-parallel size); 0 = CPU engine."""
    gpus_per_learner: int = 0
    """0 = CPU learners with gloo, 1 = one GPU per rank with nccl."""
    num_cpus: Optional[int] = None
    """CPUs a local Ray may use; unset = all."""
    torch_threads: int = 1
    """Intra-op threads per CPU worker process (keeps small machines from oversubscribing)."""
    engine_resource: Optional[str] = None
    """Custom Ray node resource that pins engines to nodes (``ray start --resources``)."""
    learner_resource: Optional[str] = None
    """Custom Ray node resource that pins learner ranks to nodes."""
    colocate: bool = False
    """Engines and learner ranks share placement bundles (engine i with rank i) instead of
    separate pools; ``train.py`` on CPU only (GPU time-sharing is not implemented)."""

    def __post_init__(self) -> None:
        _positive(self, "num_engines", "num_learners", "torch_threads")
        if self.gpus_per_engine < 0 or self.gpus_per_learner not in (0, 1):
            raise ValueError("cluster.gpus_per_engine must be >= 0 and cluster.gpus_per_learner 0 or 1")
        if self.colocate and (self.gpus_per_engine or self.gpus_per_learner):
            raise ValueError("cluster.colocate=true with GPUs would need the engines to release GPU "
                             "memory while the learners train, which is not implemented; use "
                             "separate pools (cluster.colocate=false)")


@dataclass(kw_only=True)
class LoggerConfig:
    _group = "logger"
    name: str = MISSING
    """``wandb`` or ``console``."""
    wandb: bool = False
    """Send metrics to Weights & Biases (online with WANDB_API_KEY, else offline)."""
    project: str = "rl-datapath"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team); unset = the key's default."""
    console_every: int = 1
    """Print one compact line every this many steps."""


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 50
    """Save model, optimizer, step and data position every this many steps (0 = never)."""
    dir: Optional[str] = None
    """Where to save; unset = ``<run output dir>/checkpoints``."""
    resume: Optional[str] = None
    """A checkpoint directory (``.../checkpoints/step_000050``) to resume from."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_last <= 0:
            raise ValueError("checkpoint.every must be >= 0 and checkpoint.keep_last > 0")
        if self.resume is not None and not os.path.exists(
                os.path.join(os.path.expanduser(self.resume), "trainer_state.json")):
            raise ValueError(f"checkpoint.resume={self.resume!r} is not a checkpoint "
                             "(no trainer_state.json there)")


# ---------------------------------------------------------------------------------------
# root
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Config:
    num_steps: int = 200
    """Training steps (one rollout batch and one optimizer step each)."""
    seed: int = 1
    """Seed of learners, engines and sampling."""
    run_name: Optional[str] = None
    """Run label for W&B and store keys; unset = derived from the time."""
    output_dir: Optional[str] = None
    """Where metrics, logs and checkpoints go; unset = Hydra's run directory."""
    model: ModelConfig = MISSING
    rollout: RolloutConfig = MISSING
    transfer: TransferConfig = MISSING
    weights: WeightsConfig = MISSING
    algo: AlgoConfig = MISSING
    task: TaskConfig = MISSING
    cluster: ClusterConfig = MISSING
    logger: LoggerConfig = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        _positive(self, "num_steps")
        batch, learners = self.rollout.batch_size, self.cluster.num_learners
        if batch % learners:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.n_samples_per_prompt = {batch} samples "
                f"do not split evenly over cluster.num_learners={learners}; make it a multiple")
        if self.algo.steps_per_rollout > batch // learners:
            raise ValueError(
                f"algo.steps_per_rollout={self.algo.steps_per_rollout} exceeds the {batch // learners} "
                f"samples each of the cluster.num_learners={learners} ranks gets per rollout; every "
                f"mini-batch needs at least one sample per rank")
        if self.rollout.name == "hf" and self.cluster.gpus_per_engine:
            raise ValueError("rollout=hf runs one process per engine; set cluster.gpus_per_engine=0 "
                             "or use rollout=sglang")
        if self.rollout.name == "sglang" and self.cluster.gpus_per_engine < 1:
            raise ValueError("rollout=sglang needs GPUs: set cluster.gpus_per_engine (its tensor-"
                             "parallel size) to 1 or more")

    def check_async(self) -> None:
        """What ``train_async.py`` needs beyond ``train.py`` (raised before any worker starts)."""
        if self.cluster.colocate:
            raise ValueError("train_async.py needs separate rollout and training pools (generation "
                             "overlaps training); cluster.colocate=true is supported by train.py only")
        if not self.rollout.fully_async and self.algo.max_staleness < 1:
            raise ValueError(f"algo.max_staleness={self.algo.max_staleness}: one-step off-policy "
                             f"trains every batch one version behind, so every sample would be "
                             f"dropped; use >= 1 or train.py")


_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"base": ModelConfig},
    "rollout": {"hf": HFRolloutConfig, "sglang": SGLangRolloutConfig},
    "transfer": {"ray": RayTransferConfig, "mooncake": MooncakeTransferConfig},
    "weights": {"broadcast": BroadcastWeightsConfig, "p2p": P2PWeightsConfig},
    "algo": {"grpo": AlgoConfig},
    "task": {"repeat_letter": RepeatLetterTaskConfig, "addition": AdditionTaskConfig,
             "jsonl": JsonlTaskConfig},
    "cluster": {"base": ClusterConfig},
    "logger": {"base": LoggerConfig},
}


def register_configs() -> None:
    """Register the root schema as ``schema`` and each group's schemas as ``schema/<group>/<name>``;
    the YAML files under ``conf/`` extend them."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, schemas in _SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def load(cfg: DictConfig) -> Config:
    """Composed Hydra config -> typed, validated, immutable-by-convention ``Config``."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config), type(obj)
    return obj
