"""Hugging Face export: two FSDP2 learner ranks (gloo) train a step and save with
``checkpoint.save_hf=true``; ``transformers`` loads ``<step>/hf`` and gives the learners'
logits on a fixed input, holding the trained weights in ``model.dtype``; the project's
loader takes it as ``model=hf model.path=``; ``python -m rl.learner.export_hf`` turns the
same checkpoint's shards into the same model; bad input is refused with what to do.
Two runs: the tiny model in float32, and a tied-embedding copy of it in bfloat16 mixed
precision (small Qwen2 checkpoints tie ``lm_head`` to ``embed_tokens``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rl.learner.checkpoint import write_trainer_state
from rl.learner.export_hf import copy_source_files, export_checkpoint, write_hf
from rl.model import load_model, load_tokenizer
from rl.runtime import Runtime
from tests.support.batches import make_batch
from tests.support.cluster_checks import bits
from tests.support.env import REPO, compose
from transfer.net import free_port

WORLD = 2
INPUT_IDS = torch.tensor([[3, 4, 5, 39, 30, 41, 31, 42, 32, 6, 7, 8, 39, 9, 10]])
"""A fixed input: characters of the tiny tokenizer ("abc 1+2=3def gh")."""
TEXT = "ab c:1+2=3?"


def _train_and_save(rank: int, port: int, source: str, out_dir: str, overrides: tuple[str, ...]) -> None:
    from rl.learner.learner import Learner

    cfg = compose(f"cluster.num_learners={WORLD}", "algo.micro_batch_size=4", "checkpoint.save_hf=true",
                  *overrides)
    learner = Learner(cfg, Runtime("export", out_dir, source), rank, WORLD)
    learner.setup("127.0.0.1", port)
    batch = make_batch(16, seed=0)
    learner.train_batch(batch.select(range(rank * 8, (rank + 1) * 8)))
    path = os.path.join(out_dir, "checkpoints", "step_000001")
    learner.save(path)
    master = learner.full_tensors(learner.model.named_parameters())
    # after it (a no-grad forward leaves the root module's parameters unsharded, in the compute dtype)
    with torch.no_grad():  # a collective: every rank runs the forward
        logits = learner.model(input_ids=INPUT_IDS.to(learner.device)).logits
    learner.close()
    if rank == 0:  # what the driver writes after the learners saved (rl.driver.run.maybe_save)
        write_trainer_state(path, {"step": 1, "model": {"path": source, "dtype": cfg.model.dtype}})
        torch.save({"logits": logits.float(), "master": master}, os.path.join(out_dir, "learner.pt"))


def _run(ranks, source: str, out_dir, dtype: str) -> dict:
    ranks.run(_train_and_save, (free_port(), source, str(out_dir), (f"model.dtype={dtype}",)), nprocs=WORLD)
    step = os.path.join(out_dir, "checkpoints", "step_000001")
    return {"source": source, "dtype": dtype, "step": step, "hf": os.path.join(step, "hf"),
            **torch.load(os.path.join(out_dir, "learner.pt"))}


def _tied_tiny(path: str, tiny_path: str) -> str:
    """The tiny model with ``tie_word_embeddings=true``: ``lm_head`` is the input embedding."""
    config = AutoConfig.from_pretrained(tiny_path)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    copy_source_files(tiny_path, path)  # tokenizer files and the tiny model's marker
    return path


@pytest.fixture(scope="module")
def float32_run(ranks, tiny_path, tmp_path_factory) -> dict:
    return _run(ranks, tiny_path, tmp_path_factory.mktemp("float32"), "float32")


@pytest.fixture(scope="module")
def tied_bfloat16_run(ranks, tiny_path, tmp_path_factory) -> dict:
    source = _tied_tiny(str(tmp_path_factory.mktemp("tied-source")), tiny_path)
    return _run(ranks, source, tmp_path_factory.mktemp("tied-bfloat16"), "bfloat16")


RUNS = ("float32_run", "tied_bfloat16_run")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
"""Logits: absolute tolerance of the comparison, by the dtype the model computes in."""


def _same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        assert got[name].dtype == t.dtype, (what, name)
        np.testing.assert_array_equal(bits(got[name]), bits(t), err_msg=f"{what}: {name}")


@pytest.mark.parametrize("run", RUNS)
def test_save_hf_writes_a_model_transformers_loads_with_the_learners_logits(run, request):
    r = request.getfixturevalue(run)
    dtype, tied = getattr(torch, r["dtype"]), run.startswith("tied")
    files = set(os.listdir(r["hf"]))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files, files
    assert not [d for d in os.listdir(r["step"]) if "partial" in d]  # written aside, moved in whole
    with open(os.path.join(r["hf"], "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == config["torch_dtype"] == r["dtype"]
    assert config["tie_word_embeddings"] is tied

    model = AutoModelForCausalLM.from_pretrained(r["hf"])  # its dtype from config.json
    assert model.dtype == dtype and all(t.dtype == torch.float32 for t in r["master"].values())
    # the trained weights, cast to model.dtype as the engines get them
    want = {n: t.to(dtype) for n, t in r["master"].items()}
    _same_weights({n: p.detach() for n, p in model.named_parameters()}, want, "from_pretrained")
    saved = load_file(os.path.join(r["hf"], "model.safetensors"))
    if tied:  # written once, as save_pretrained writes a tied model, and tied again on load
        assert "lm_head.weight" not in saved and "lm_head.weight" not in r["master"]
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert "lm_head.weight" in saved
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS).logits.float()
    tol = TOLERANCE[r["dtype"]]
    torch.testing.assert_close(logits, r["logits"], atol=tol, rtol=tol)


@pytest.mark.parametrize("run", RUNS)
def test_the_export_trains_and_serves_as_model_hf(run, request):
    """What ``model=hf model.path=<hf>`` runs: the config composes, and the loader that
    learners and engines use loads the trained weights and the run's own tokenizer."""
    r = request.getfixturevalue(run)
    cfg = compose("model=hf", f"model.path={r['hf']}", f"model.dtype={r['dtype']}")
    assert cfg.model.path == r["hf"]
    model = load_model(r["hf"], cfg.model.master_dtype)
    want = {n: t.to(getattr(torch, r["dtype"])).float() for n, t in r["master"].items()}
    _same_weights({n: p.detach() for n, p in model.named_parameters()}, want, "load_model")
    # the tiny model's character tokenizer, as the run used it (its marker file came along);
    # AutoTokenizer reads the export as it reads the source directory
    assert load_tokenizer(r["hf"])(TEXT).input_ids == load_tokenizer(r["source"])(TEXT).input_ids
    assert len(load_tokenizer(r["hf"])(TEXT).input_ids) == len(TEXT)
    assert AutoTokenizer.from_pretrained(r["hf"])(TEXT).input_ids == \
        AutoTokenizer.from_pretrained(r["source"])(TEXT).input_ids


def _weights(path: str) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}


@pytest.mark.parametrize("run", RUNS)
def test_the_converter_turns_the_shards_into_the_same_model(run, request, tmp_path):
    r = request.getfixturevalue(run)
    out = tmp_path / "exported"
    export_checkpoint(r["step"], str(out))  # the model and dtype that trainer_state.json records
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == open(os.path.join(r["hf"], name), "rb").read(), name
    saved = load_file(os.path.join(r["hf"], "model.safetensors"))
    _same_weights(load_file(str(out / "model.safetensors")), saved, "converted vs saved by the run")

    # the float32 master weights exactly, in shards with an index
    exact = tmp_path / "float32"
    export_checkpoint(r["step"], str(exact), dtype="float32", max_shard_size="50KB")
    assert (exact / "model.safetensors.index.json").exists()
    assert len([f for f in os.listdir(exact) if f.endswith(".safetensors")]) > 1
    _same_weights(_weights(str(exact)), r["master"], "float32 shards")


def test_the_converter_runs_as_a_command_and_reports_errors(float32_run, tmp_path):
    cmd = [sys.executable, "-m", "rl.learner.export_hf"]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([*cmd, float32_run["step"], str(tmp_path / "out")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "reading the model shards of" in proc.stdout and "done: config.json" in proc.stdout
    _same_weights(_weights(str(tmp_path / "out")), float32_run["master"], "command")
    proc = subprocess.run([*cmd, str(tmp_path / "nowhere"), str(tmp_path / "x")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: {tmp_path / 'nowhere'}: no such directory"


def test_bad_input_is_refused_with_what_to_do(float32_run, tied_bfloat16_run, chat_model_path, tmp_path):
    step, out = float32_run["step"], str(tmp_path / "out")

    def refused(fragment: str, *args, **kwargs) -> None:
        with pytest.raises(ValueError) as e:
            export_checkpoint(*args, **kwargs)
        assert fragment in str(e.value), str(e.value)

    refused("no such directory", str(tmp_path / "nowhere"), out)
    root = os.path.dirname(step)  # the checkpoints directory, not one of its steps
    refused("is not a checkpoint of this trainer (no learner/.metadata): it holds step_000001: "
            "pass one of them", root, out)
    run_dir = os.path.dirname(root)  # the run's output directory
    refused("it holds checkpoints/step_000001: pass one of them", run_dir, out)
    refused("pass a step directory", str(tmp_path), out)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    refused("exists and is not an empty directory", step, str(tmp_path / "full"))

    incomplete = tmp_path / "incomplete"  # the shards, without the driver's trainer_state.json
    shutil.copytree(os.path.join(step, "learner"), incomplete / "learner")
    refused("it has no trainer_state.json (incomplete", str(incomplete), out)
    write_trainer_state(str(incomplete), {"step": 1, "model": {"path": str(tmp_path / "gone")}})
    refused(f"the model recorded in trainer_state.json, {tmp_path / 'gone'}, is not a Hugging Face "
            "model directory (no config.json there): pass --model-path", str(incomplete), out)
    refused("--model-path, ", str(incomplete), out, model_path=str(tmp_path))

    # another model: a Llama of other sizes; the tied copy of the tiny model (the run trained
    # a separate lm_head, which a tied config would drop)
    refused(f"the weights are not those of the model at {chat_model_path}: not in the model: ", step, out,
            model_path=chat_model_path)
    refused("ties lm_head.weight to model.embed_tokens.weight, but the weights hold two different "
            "tensors", step, out, model_path=tied_bfloat16_run["source"])
    assert not os.path.exists(out)  # nothing written by a refused conversion
    assert not [d for d in os.listdir(tmp_path) if "partial" in d]


def test_write_hf_carries_a_chat_models_tokenizer_and_template(chat_model_path, tmp_path):
    """A real-style checkpoint (Llama, a tokenizer with added role tokens and a chat
    template): the export's tokenizer renders and encodes as the source's, and ``model=hf``
    with ``model.chat_template=true`` accepts it."""
    source = load_model(chat_model_path)
    out = str(tmp_path / "hf")
    write_hf(out, {n: p.detach() for n, p in source.named_parameters()}, chat_model_path, "bfloat16")
    messages = [{"role": "user", "content": "1+1=?"}]
    got, want = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(chat_model_path)
    assert got.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        want.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got(TEXT + "<|user|>").input_ids == want(TEXT + "<|user|>").input_ids
    compose("model=hf", f"model.path={out}", "model.chat_template=true")
    _same_weights(_weights(out), {n: p.detach().to(torch.bfloat16) for n, p in source.named_parameters()},
                  "chat model")
