"""Every YAML under conf/ composes; bad input fails early with a message naming the field."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.env import CONF, compose

GROUPS = sorted(d for d in os.listdir(CONF) if os.path.isdir(os.path.join(CONF, d)) and d != "experiment")
"""The config groups; ``experiment`` holds presets over them (``@package _global_``)."""
EXPERIMENTS = sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "experiment")) if f.endswith(".yaml"))


def _required(group: str, option: str, tmp_path, tiny_path) -> list[str]:
    """Overrides a choice needs to compose (a checkpoint path, a data file)."""
    if (group, option) == ("model", "hf"):
        return [f"model.path={tiny_path}"]
    if (group, option) == ("cluster", "two_node_8x8"):
        return ["rollout=sglang", "model.dtype=bfloat16"]
    if (group, option) == ("rollout", "sglang"):
        return ["cluster.gpus_per_engine=1", "model.dtype=bfloat16"]
    if (group, option) == ("task", "repeat_count"):
        return ["rollout.max_new_tokens=41"]  # its longest answer, 40 letters, and the EOS
    if (group, option) == ("task", "calculator"):  # its tool loop, and room for call, result, answer
        return ["rollout.function=rl.rollout.functions:calculator_tool", "rollout.max_new_tokens=16"]
    if (group, option) == ("task", "jsonl"):
        data = tmp_path / "train.jsonl"
        data.write_text(json.dumps({"prompt": "a:", "label": "aaaa"}) + "\n")
        return [f"task.path={data}"]
    return []


def test_every_group_is_present():
    assert set(GROUPS) >= {"model", "rollout", "transfer", "weights", "algo", "task", "cluster",
                           "logger"}


@pytest.mark.parametrize("group,option", [
    (g, f[:-5]) for g in GROUPS for f in sorted(os.listdir(os.path.join(CONF, g))) if f.endswith(".yaml")])
def test_every_yaml_composes(group, option, tmp_path, tiny_path):
    """Each YAML composes (with the overrides it needs), names itself, and every value it
    sets is the value the typed config holds (a size in bytes)."""
    from omegaconf import OmegaConf

    from rl.config import parse_size

    required = _required(group, option, tmp_path, tiny_path)
    node = getattr(compose(f"{group}={option}", *required), group)
    assert node.name == option, (group, option, node)
    overridden = {o.split("=", 1)[0].removeprefix(f"{group}.") for o in required}
    values = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, group, f"{option}.yaml")))
    checked = 0
    for key, want in values.items():
        if key == "defaults" or key in overridden:
            continue
        got = getattr(node, key)
        if isinstance(want, str) and isinstance(got, int) and not isinstance(got, bool):
            want = parse_size(want, f"{group}.{key}")
        assert got == want, (group, option, key, got, want)
        checked += 1
    assert checked or values.keys() <= {"defaults"}, (group, option)


def _leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict) and "_target_" not in value:
            yield from _leaves(value, f"{prefix}{key}.")
        elif key != "defaults":
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_holds_its_values(name, tmp_path, chat_model_path):
    """A preset composes with the paths only a user knows (checkpoint, data), and the typed
    config holds every value it sets."""
    from functools import reduce

    from omegaconf import OmegaConf

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+3?", "label": "5"}) + "\n")
    cfg = compose(f"experiment={name}", f"model.path={chat_model_path}", f"task.path={data}")
    values = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "experiment", f"{name}.yaml")))
    from rl.config import parse_size

    for key, want in _leaves(values):
        got = reduce(getattr, key.split("."), cfg)
        if isinstance(want, str) and isinstance(got, int) and not isinstance(got, bool):
            want = parse_size(want, key)
        assert got == want, (name, key, got, want)


def test_the_real_model_preset_trains_a_real_model_as_the_field_does(tmp_path, chat_model_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+3?", "label": "5"}) + "\n")
    cfg = compose("experiment=qwen2_5_gsm8k", f"model.path={chat_model_path}", f"task.path={data}")
    assert (cfg.model.name, cfg.rollout.name, cfg.task.name, cfg.cluster.name) == \
        ("hf", "sglang", "jsonl", "two_node_8x8")
    assert (cfg.model.dtype, cfg.model.master_dtype) == ("bfloat16", "float32") and cfg.model.mixed_precision
    assert cfg.model.chat_template and cfg.algo.lr <= 1e-5
    assert cfg.task.reward["_target_"] == "rl.tasks.rewards.math_answer"
    with pytest.raises(ValueError, match="model=hf needs model.path"):
        compose("experiment=qwen2_5_gsm8k", f"task.path={data}")


def test_defaults():
    cfg = compose()
    assert (cfg.model.name, cfg.rollout.name, cfg.transfer.name, cfg.weights.name, cfg.task.name,
            cfg.cluster.name, cfg.logger.name) == ("tiny", "hf", "ray", "broadcast",
                                                    "repeat_letter", "local", "wandb")
    assert cfg.cluster.num_engines >= 2 and cfg.cluster.num_learners >= 2
    assert cfg.weights.bucket_bytes == 512 << 20


@pytest.mark.parametrize("value,expected", [("512mb", 512 << 20), ("2gb", 2 << 30), (1024, 1024),
                                            ("1.5kb", 1536), ("64", 64)])
def test_sizes(value, expected):
    assert compose(f"weights.bucket_bytes={value}").weights.bucket_bytes == expected


@pytest.mark.parametrize("override,fragment", [
    ("rollout.prompts_per_step=0", "rollout.prompts_per_step=0 must be > 0"),
    ("rollout.n_samples_per_prompt=-2", "rollout.n_samples_per_prompt=-2 must be > 0"),
    ("algo.micro_batch_size=0", "algo.micro_batch_size=0 must be > 0"),
    ("weights.bucket_bytes='2 gigs'", "weights.bucket_bytes='2 gigs' is not a size"),
    (("model=hf", "model.path=/nonexistent/ckpt"),
     "model.path='/nonexistent/ckpt' is not a Hugging Face"),
    ("model.path=/ckpt/Qwen", "is set on model=tiny (the default), which would train the built-in"),
    ("model=hf", "model=hf needs model.path=/path/to/checkpoint"),
    ("model.chat_template=true", "the built-in tiny model's tokenizer has no chat template"),
    (("rollout=sglang", "cluster.gpus_per_engine=1"), "name an attention backend that takes float32"),
    ("cluster.num_learners=5", "do not split evenly over cluster.num_learners"),
    ("checkpoint.resume=/nonexistent", "checkpoint.resume='/nonexistent' is not a checkpoint"),
    (("checkpoint.save_hf=true", "checkpoint.every=0"),
     "checkpoint.save_hf=true writes the Hugging Face model beside each checkpoint, and checkpoint.every=0"),
    ("eval.every=-1", "eval.every=-1 must be >= 0"),
    ("eval.n_samples=0", "eval.num_prompts=32 and eval.n_samples=0 must be >= 1"),
    ("eval.path=/nonexistent.jsonl", "eval.path='/nonexistent.jsonl' does not exist"),
    ("algo.max_staleness=-1", "algo.max_staleness=-1 must be >= 0"),
    ("rollout.max_inflight_batches=0", "rollout.max_inflight_batches=0: the queue needs room"),
    ("rollout.batch_wait_ms=-1", "rollout.batch_wait_ms=-1.0 must be >= 0"),
    ("rollout.pause_mode=abort", "'abort' would end the requests in flight"),
    (("cluster.gpus_per_learner=1", "cluster.colocate=true"), "cluster.colocate=true with GPUs"),
    ("cluster.gpus_per_engine=1", "rollout=hf runs one process per engine"),
    ("rollout=sglang", "rollout=sglang needs GPUs: set cluster.gpus_per_engine"),
    ("log_level=info", "log_level='info' is not a level; use one of DEBUG, INFO, WARNING, ERROR"),
])
def test_bad_values_name_the_field(override, fragment):
    with pytest.raises(ValueError, match=None) as e:
        compose(*([override] if isinstance(override, str) else override))
    assert fragment in str(e.value)


def test_a_checkpoint_without_a_chat_template_is_refused_when_one_is_asked_for(tiny_path, chat_model_path):
    with pytest.raises(ValueError, match="has no chat template"):
        compose("model=hf", f"model.path={tiny_path}", "model.chat_template=true")
    cfg = compose("model=hf", f"model.path={chat_model_path}", "model.chat_template=true")
    assert cfg.model.chat_template


def test_float32_sglang_engines_only_with_an_attention_backend_that_takes_it():
    gpu = ("rollout=sglang", "cluster.gpus_per_engine=1")
    assert compose(*gpu, "model.dtype=bfloat16").model.dtype == "bfloat16"
    for ok in ("[--attention-backend,triton]",
               "[--attention-backend,torch_native,--decode-attention-backend,triton]",
               "[--prefill-attention-backend,triton,--decode-attention-backend,torch_native]"):
        assert compose(*gpu, f"rollout.extra_args={ok}").rollout.extra_args
    for refused in ("[--attention-backend,fa3]",
                    "[--attention-backend,triton,--prefill-attention-backend,fa3]",
                    "[--decode-attention-backend,triton]"):
        with pytest.raises(ValueError, match="rollout=sglang with model.dtype=float32"):
            compose(*gpu, f"rollout.extra_args={refused}")


def test_unknown_key_is_named():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose("transfer.protocl=tcp")
    assert "transfer.protocl" in str(e.value)


def test_wrong_type_is_named():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose("cluster.num_engines=two")
    assert "num_engines" in str(e.value)


def test_unknown_option_is_rejected():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as e:
        compose("task=nope")
    assert "task/nope" in str(e.value) or "nope" in str(e.value)
