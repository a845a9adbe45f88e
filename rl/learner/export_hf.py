"""The trained policy as a Hugging Face model directory.

Two ways in: ``checkpoint.save_hf=true`` writes ``<step dir>/hf`` beside each checkpoint
(``Learner.save_hf``: every rank gathers the whole parameters, rank 0 writes), and the
command below converts a checkpoint saved earlier, in one process, without Ray or engines::

    python -m rl.learner.export_hf <step dir> <out dir> [--model-path DIR] [--dtype DTYPE]

The directory holds ``config.json`` (the source model's, with ``dtype`` and ``torch_dtype``
set to the weights' dtype), the weights as safetensors (``model.safetensors``, or shards and
``model.safetensors.index.json`` above ``max_shard_size``), and every other top-level file of
the source model the run started from (``runtime.model_path``) except its weights: tokenizer
files, ``generation_config.json``, chat template, license, the tiny model's marker.
``transformers.AutoModelForCausalLM.from_pretrained`` loads it, and so does ``model=hf
model.path=<dir>`` (learners and engines).

Weights are written in ``model.dtype`` by default: what the run's engines served (bfloat16
on GPU runs), half the bytes of the float32 master weights; ``--dtype float32`` converts the
master weights exactly. Tied embeddings (``tie_word_embeddings``) are written once, as
``save_pretrained`` writes them: the learner holds one tensor for both names.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from typing import TYPE_CHECKING

from rl.config import DTYPE_BYTES
from rl.learner.checkpoint import TRAINER_STATE, read_trainer_state
from rl.log import setup_logging

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

HF_DIR = "hf"
"""The export's directory inside a checkpoint step directory."""
MAX_SHARD_SIZE = "5GB"
"""Largest safetensors file before the weights are split into shards (the Hub's convention)."""
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx",
                ".index.json")
"""Source model files that are weights (or their index): never copied, the export writes its own."""
DCP_DIR = "learner"
"""Where ``checkpoint.save_learner`` puts the model and optimizer shards."""


def write_hf(out: str, state: dict[str, torch.Tensor], source: str, dtype: str,
             max_shard_size: str = MAX_SHARD_SIZE) -> None:
    """Write ``state`` (parameter name -> whole tensor) as a Hugging Face model directory at
    ``out``, with the config and tokenizer files of the model at ``source``. Raises
    ``ValueError`` when the weights do not fit that model. Written aside and moved into
    place: ``out`` holds a whole export or none (an earlier one there is replaced)."""
    # torch and transformers in the functions (start-up cost, about 3 s): the command's
    # --help and its checks of the paths answer at once
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress lines instead of tqdm's
    model = empty_model(source, dtype)
    state = fit_to(model, state, source)
    torch_dtype = getattr(torch, dtype)
    state = {n: (t.to(torch_dtype) if t.is_floating_point() else t).contiguous() for n, t in state.items()}
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the export from the users it is for
    try:
        model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
        copy_source_files(source, tmp)
        config = os.path.join(tmp, "config.json")
        with open(config) as f:
            c = json.load(f)
        # transformers 5 writes "dtype"; older readers (transformers 4, serving tools) "torch_dtype"
        c["dtype"] = c["torch_dtype"] = dtype
        with open(config, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
            f.write("\n")
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def empty_model(source: str, dtype: str):
    """The source model's architecture on the meta device (no memory), in ``dtype``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def fit_to(model, state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``state`` with one name per tensor, as ``model`` has them; ``ValueError`` naming what
    differs when the weights are not this model's (names, shapes, a tie the config makes
    that the weights do not)."""
    import torch

    first: dict[int, str] = {}
    alias = {}  # tied names -> the name that owns the tensor (lm_head.weight -> embed_tokens)
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), name)
        if owner != name:
            alias[name] = owner
    state = dict(state)
    for name, owner in alias.items():
        if name in state:
            t = state.pop(name)
            if owner in state and not torch.equal(t, state[owner]):
                raise ValueError(f"the config at {source} ties {name} to {owner}, but the weights hold "
                                 f"two different tensors: they were trained from another model")
            state.setdefault(owner, t)
    want = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in alias}
    problems = []
    if missing := sorted(want.keys() - state.keys()):
        problems.append(f"missing {_some(missing)}")
    if unexpected := sorted(state.keys() - want.keys()):
        problems.append(f"not in the model: {_some(unexpected)}")
    if shapes := [f"{n} {tuple(state[n].shape)} (the model's: {want[n]})"
                  for n in sorted(want.keys() & state.keys()) if tuple(state[n].shape) != want[n]]:
        problems.append(f"other shapes: {_some(shapes)}")
    if problems:
        raise ValueError(f"the weights are not those of the model at {source}: {'; '.join(problems)}. "
                         f"Pass the model the run started from (its model.path)")
    return state


def _some(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" ({len(items)} in all)" if len(items) > n else "")


def copy_source_files(source: str, out: str) -> None:
    """The source model's top-level files other than weights and config.json (tokenizer,
    generation config, chat templates, license, ...), over what ``save_pretrained`` wrote."""
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if name.startswith(".") or name == "config.json" or name.endswith(WEIGHT_FILES):
            continue
        if os.path.isfile(path):
            shutil.copy(path, os.path.join(out, name))
        elif name == "additional_chat_templates":  # transformers' directory of named templates
            shutil.copytree(path, os.path.join(out, name))


# -- the command: a saved checkpoint -> a Hugging Face directory -----------------------------

def check_checkpoint_dir(step: str) -> None:
    """A checkpoint step directory with its model shards, or a ``ValueError`` saying what to pass."""
    if not os.path.isdir(step):
        raise ValueError(f"{step}: no such directory")
    if os.path.exists(os.path.join(step, DCP_DIR, ".metadata")):
        return
    steps = sorted(d for d in os.listdir(step) if d.startswith("step_"))
    if not steps and os.path.isdir(os.path.join(step, "checkpoints")):  # a run's output directory
        steps = sorted(os.path.join("checkpoints", d) for d in os.listdir(os.path.join(step, "checkpoints"))
                       if d.startswith("step_"))
    hint = (f"it holds {_some(steps)}: pass one of them" if steps else
            "pass a step directory, e.g. outputs/<date>/<time>/checkpoints/step_000050")
    raise ValueError(f"{step} is not a checkpoint of this trainer (no {DCP_DIR}/.metadata): {hint}")


def model_source(step: str, model_path: str | None) -> tuple[str, str | None]:
    """(the model directory the run started from, the run's ``model.dtype`` or None):
    ``model_path`` when given, else what the checkpoint's trainer_state.json records."""
    recorded = {}
    if os.path.exists(os.path.join(step, TRAINER_STATE)):
        recorded = read_trainer_state(step).get("model") or {}
    path = model_path or recorded.get("path")
    if path is None:
        why = ("its trainer_state.json names no model" if os.path.exists(os.path.join(step, TRAINER_STATE))
               else "it has no trainer_state.json (incomplete: the run stopped while saving it)")
        raise ValueError(f"which model was {step} trained from? {why}: pass --model-path (the run's "
                         f"model.path; for the built-in tiny model its directory under "
                         f"~/.cache/rl-datapath)")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(os.path.join(path, "config.json")):
        where = "--model-path" if model_path else f"the model recorded in {TRAINER_STATE}"
        raise ValueError(f"{where}, {path}, is not a Hugging Face model directory (no config.json "
                         f"there){'' if model_path else ': pass --model-path'}")
    return path, recorded.get("dtype")


def read_checkpoint_model(step: str) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint's shards, whole, in this process (no process group):
    names as the learner's model has them, in the dtype saved (``model.master_dtype``)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(os.path.join(step, DCP_DIR))
    # keys are flattened: "model.<parameter name>" (and "optim.*", which is not read)
    state = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # one process on purpose: no_dist says so, DCP warns anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state


def export_checkpoint(step: str, out: str, model_path: str | None = None, dtype: str | None = None,
                      max_shard_size: str = MAX_SHARD_SIZE) -> None:
    """Convert the checkpoint at ``step`` into a Hugging Face model directory ``out`` (new or
    empty); ``dtype`` None: the run's ``model.dtype``, else the dtype the weights were saved in."""
    step = os.path.abspath(os.path.expanduser(step))
    out = os.path.abspath(os.path.expanduser(out))
    check_checkpoint_dir(step)  # the checks first, before torch loads
    source, run_dtype = model_source(step, model_path)
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out)):
        raise ValueError(f"{out} exists and is not an empty directory: choose a new one")
    import torch

    logger.info("reading the model shards of %s", step)
    state = read_checkpoint_model(step)
    saved = str(next(iter(state.values())).dtype).removeprefix("torch.") if state else "float32"
    dtype = dtype or run_dtype or saved
    logger.info("%d tensors, %.1f MB in %s; the model's config and tokenizer from %s", len(state),
                sum(t.numel() * t.element_size() for t in state.values()) / 1e6, saved, source)
    logger.info("writing %s (weights in %s)", out, dtype)
    for name, t in state.items():  # one tensor at a time: never two whole copies in memory
        if t.is_floating_point():
            state[name] = t.to(getattr(torch, dtype))
    write_hf(out, state, source, dtype, max_shard_size)
    logger.info("done: %s", ", ".join(sorted(os.listdir(out))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rl.learner.export_hf",
        description="Convert a checkpoint (torch.distributed.checkpoint shards) into a Hugging Face "
                    "model directory that transformers and model=hf model.path=<out> load. One "
                    "process, no Ray, no engines.")
    parser.add_argument("checkpoint", help="a checkpoint step directory, e.g. "
                                           "outputs/<date>/<time>/checkpoints/step_000050")
    parser.add_argument("out", help="the directory to write (new, or empty)")
    parser.add_argument("--model-path", help="the model the run started from, whose config and "
                        "tokenizer files are used (default: the one the checkpoint's trainer_state.json "
                        "records)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="dtype of the written weights "
                        "(default: the run's model.dtype, what its engines served; float32 keeps the "
                        "float32 master weights exactly)")
    parser.add_argument("--max-shard-size", default=MAX_SHARD_SIZE,
                        help="largest safetensors file before the weights are split into shards "
                             f"(default {MAX_SHARD_SIZE})")
    args = parser.parse_args(argv)
    setup_logging("INFO")
    try:
        export_checkpoint(args.checkpoint, args.out, args.model_path, args.dtype, args.max_shard_size)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
