"""``rollout`` group: sampling settings shared by every engine, and one schema per engine
kind (``hf``: the CPU engine, ``sglang``), each knowing what it needs of the placement
(``check_cluster``) and of the model (``check_model``). The command that starts each kind
is composed in ``rl/rollout/engines/commands.py``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import MISSING

from rl.config.checks import positive

DEFAULT_ROLLOUT_FUNCTION = "rl.rollout.functions:single_turn"
_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

if TYPE_CHECKING:
    from rl.config.cluster import ClusterConfig
    from rl.config.model import ModelConfig


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
    """Bound on one ``/health`` answer while an engine starts (SGLang answers 503 while
    loading, and may run a one-token generation and sleep 1 s before answering 200), and on
    one ``/health_generate`` answer once it serves: slower, and the engine is replaced."""
    fault_tolerance: bool = True
    """Replace an engine that dies or stops generating, and send its requests to the others
    (docs/fault-tolerance.md); false: the first engine death ends the run, naming it."""
    health_check_interval_s: float = 10.0
    """How often each engine in service is asked ``/health_generate`` (a dead process is
    noticed within half a second either way)."""
    health_check_first_wait_s: float = 10.0
    """No ``/health_generate`` for this long after an engine comes into service."""
    max_engine_restarts: int = 4
    """Engine replacements a run may make; one more death ends it with an error naming the
    engines and their last log lines."""
    fully_async: bool = False
    """``train_async.py`` only: engines generate continuously into a bounded queue instead of
    one batch ahead (weight syncs pause and continue them)."""
    max_inflight_batches: int = 2
    """Fully async: batches generated or being generated and not yet trained on; it bounds
    the batches held in the store, and a sample's staleness to this minus one."""
    function: str = DEFAULT_ROLLOUT_FUNCTION
    """The rollout function, ``module:callable``: turns one prompt group into its samples
    (single-turn by default; multi-turn tool use: ``rl.rollout.functions:calculator_tool``;
    your own: docs/rollout.md). Imported before anything starts."""
    dump_every: int = 0
    """Write every this many steps' samples (prompt, response text and ids, loss mask,
    log-probs, reward) to ``<output_dir>/rollouts/step_<step>.jsonl`` (0 = never), on the
    rollout manager's node."""
    pause_mode: str = "retract"
    """How engines pause for a weight sync (SGLang's ``pause_generation`` mode): ``retract``
    or ``in_place``; requests in flight are kept either way."""

    def __post_init__(self) -> None:
        positive(self, "prompts_per_step", "n_samples_per_prompt", "max_new_tokens", "max_prompt_tokens",
                  "request_timeout_s", "engine_start_timeout_s", "health_check_timeout_s",
                  "health_check_interval_s")
        if self.dump_every < 0:
            raise ValueError(f"rollout.dump_every={self.dump_every} must be >= 0 (0 = never)")
        if self.health_check_first_wait_s < 0 or self.max_engine_restarts < 0:
            raise ValueError("rollout.health_check_first_wait_s and rollout.max_engine_restarts "
                             "must be >= 0")
        if self.max_inflight_batches < 1:
            raise ValueError(f"rollout.max_inflight_batches={self.max_inflight_batches}: the queue "
                             f"needs room for at least 1 batch (2 or more lets generation overlap training)")
        if self.pause_mode not in ("retract", "in_place"):
            raise ValueError(f"rollout.pause_mode={self.pause_mode!r}: use 'retract' or 'in_place' "
                             f"('abort' would end the requests in flight)")
        if not _FUNCTION_PATH.match(self.function):
            raise ValueError(f"rollout.function={self.function!r}: name it as module:callable, "
                             f"e.g. {DEFAULT_ROLLOUT_FUNCTION}")
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

    def check_cluster(self, cluster: "ClusterConfig") -> None:
        """Cross-check with the placement (called by the root config): what this engine
        kind needs of ``cluster.gpus_per_engine``."""

    def check_model(self, model: "ModelConfig") -> None:
        """Cross-check with the model (called by the root config): the dtypes this engine
        kind serves."""


@dataclass(kw_only=True)
class HFRolloutConfig(RolloutConfig):
    name: str = "hf"
    max_batch_size: int = 256
    """Most requests the CPU engine decodes together."""
    batch_wait_ms: float = 5.0
    """A batch starts once no request has arrived for this long (ms), or at max_batch_size;
    requests arriving while it decodes join it at a step once enough wait."""
    device: str = "cpu"
    """Device of the CPU engine's model (``cpu``; ``cuda`` works where available)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_batch_size")
        if self.batch_wait_ms < 0:
            raise ValueError(f"rollout.batch_wait_ms={self.batch_wait_ms} must be >= 0")

    def check_cluster(self, cluster: "ClusterConfig") -> None:
        if cluster.gpus_per_engine:
            raise ValueError("rollout=hf runs one process per engine; set cluster.gpus_per_engine=0 "
                             "or use rollout=sglang")


FLOAT32_ATTENTION_BACKENDS = ("triton", "torch_native", "flex_attention")
"""SGLang attention backends whose kernels take float32 (Triton and PyTorch code). The
others are FlashAttention / FlashInfer-class kernels that take float16 and bfloat16 only,
and SGLang 0.5.23 picks fa3 on Hopper whatever the dtype (``get_default_attn_backend``).
Both phases must be covered: ``--attention-backend``, or the prefill and decode ones."""
ATTENTION_BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend",
                           "--decode-attention-backend")


def flag_values(args: list[str], flag: str) -> list[str]:
    """Every value given to ``flag`` in an argument list (``--flag v`` or ``--flag=v``)."""
    args = [str(a) for a in args]
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    values += [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values


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
                             "receive the weights in it); set model.dtype instead")

    def check_cluster(self, cluster: "ClusterConfig") -> None:
        if cluster.gpus_per_engine < 1:
            raise ValueError("rollout=sglang needs GPUs: set cluster.gpus_per_engine (its tensor-"
                             "parallel size) to 1 or more")

    def check_model(self, model: "ModelConfig") -> None:
        if model.dtype != "float32":
            return
        named = {f: flag_values(self.extra_args, f) for f in ATTENTION_BACKEND_FLAGS}
        covered = named["--attention-backend"] or (named["--prefill-attention-backend"]
                                                   and named["--decode-attention-backend"])
        if covered and all(v in FLOAT32_ATTENTION_BACKENDS for vs in named.values() for v in vs):
            return
        raise ValueError(
            "rollout=sglang with model.dtype=float32: SGLang's default attention kernels on GPUs "
            "(fa3 on Hopper, flashinfer or trtllm_mha elsewhere) take float16/bfloat16 only. Set "
            "model.dtype=bfloat16 (the learner keeps float32 master weights, model.master_dtype), "
            "or name an attention backend that takes float32: "
            "rollout.extra_args='[--attention-backend,triton]' (also "
            f"{', '.join(FLOAT32_ATTENTION_BACKENDS[1:])})")


SCHEMAS: dict[str, type] = {"hf": HFRolloutConfig, "sglang": SGLangRolloutConfig}
"""Schema of each engine kind (``schema/rollout/<key>``)."""
