"""SGLang's own code from the pinned release, loaded on a machine without a GPU.

The contract tests hold our client, our sender and the CPU engine to these, never to a
reading of SGLang written here. What imports on CPU is imported (``sglang.api.v1.api_types``,
the ``/generate`` schema the server's contract gate uses; ``sglang.srt.utils.common``, whose
``init_custom_process_group`` builds the engine side of a weight-update group). Modules
that pull in CUDA-only or vision packages on import (``managers/io_struct.py``,
``entrypoints/http_server.py``, ``model_runner_components/weight_updater.py``) are read from
the installed wheel's source with ``ast``: their request classes, routes and the engine's
receive method are taken verbatim from there and executed in a namespace of their own.
"""

from __future__ import annotations

import __future__
import ast
import functools
import importlib.metadata
import logging
import os
import typing
from dataclasses import dataclass

from rl.rollout.sglang_version import SGLANG_VERSION


def check_pinned() -> str:
    """The installed SGLang wheel's version; the pinned release or an error that says so."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the SGLang wheel is not installed: `make test` installs "
                           f"sglang=={SGLANG_VERSION} (--no-deps) for the contract tests") from None
    if version != SGLANG_VERSION:
        raise RuntimeError(f"installed sglang {version}, pinned {SGLANG_VERSION} "
                           f"(rl/rollout/sglang_version.py): reinstall with `make venv`")
    return version


def source_path(module: str) -> str:
    """Path of ``module``'s source inside the installed wheel, without importing it."""
    import importlib.util

    root = os.path.dirname(importlib.util.find_spec("sglang").origin)
    return os.path.join(root, *module.split(".")[1:]) + ".py"


@functools.lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    with open(source_path(module)) as f:
        return ast.parse(f.read())


def _class_defs(module: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in _tree(module).body if isinstance(n, ast.ClassDef)}


# -- request types (managers/io_struct.py) --------------------------------------------------
IO_STRUCT = "sglang.srt.managers.io_struct"


@functools.lru_cache(maxsize=None)
def request_classes() -> dict[str, type]:
    """Every ``*ReqInput`` class of ``io_struct`` that derives from ``BaseReq`` with plain
    field types (the control routes' bodies), executed from the wheel's source."""
    import msgspec
    from sglang.srt.utils.msgspec_utils import msgspec_struct_pydantic_core_schema

    defs = _class_defs(IO_STRUCT)
    ns: dict = {name: getattr(typing, name) for name in typing.__all__}
    ns.update(msgspec=msgspec, msgspec_struct_pydantic_core_schema=msgspec_struct_pydantic_core_schema,
              __name__="sglang_io_struct_subset")
    wanted = ["BaseReq"] + [n for n, d in defs.items() if n.endswith("ReqInput")
                            and any(isinstance(b, ast.Name) and b.id == "BaseReq" for b in d.bases)]
    out = {}
    for name in wanted:
        try:
            # annotations evaluated here, in ``ns`` (msgspec cannot resolve strings later)
            exec(compile(ast.Module(body=[defs[name]], type_ignores=[]), source_path(IO_STRUCT),
                         "exec", dont_inherit=True), ns)
        except NameError:
            continue  # a field typed by another io_struct type: not a body this project sends
        out[name] = ns[name]
    return out


def validate_body(cls: type, body: dict):
    """Validate ``body`` as the server does (FastAPI runs the class's pydantic schema), and
    refuse keys the class lacks: SGLang ignores them silently, which would hide a typo."""
    import msgspec
    from pydantic import TypeAdapter

    fields = {f.name for f in msgspec.structs.fields(cls)}
    unknown = set(body) - fields
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return TypeAdapter(cls).validate_python(body)


# -- routes (entrypoints/http_server.py) ---------------------------------------------------------
HTTP_SERVER = "sglang.srt.entrypoints.http_server"


@dataclass(frozen=True)
class Route:
    path: str
    methods: frozenset[str]
    body_type: str | None
    """Name of the class the handler's ``obj`` parameter is parsed into (None: no body)."""


@functools.lru_cache(maxsize=None)
def routes() -> dict[str, Route]:
    """Every literal route of the HTTP server: path -> methods and body type."""
    out: dict[str, Route] = {}
    for node in ast.walk(_tree(HTTP_SERVER)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_type = None
        for arg in node.args.args:
            if arg.arg == "obj" and arg.annotation is not None:
                ann = arg.annotation
                if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple):
                    ann = ann.slice.elts[0]  # Annotated[X, Body()]
                if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Optional":
                    ann = ann.slice  # Annotated[Optional[X], Body()] = None: the body may be left out
                body_type = ann.id if isinstance(ann, ast.Name) else None
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            if not (dec.args and isinstance(dec.args[0], ast.Constant)):
                continue  # a route named by an environment variable
            path, kind = dec.args[0].value, dec.func.attr
            if kind == "api_route":
                methods = next(ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods")
            else:
                methods = [kind.upper()]
            prev = out.get(path)
            out[path] = Route(path, frozenset(methods) | (prev.methods if prev else frozenset()),
                              body_type)
    return out


# -- the engine's side of a weight-update group ------------------------------------------------
WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"


class EngineWeightUpdater:
    """SGLang's ``WeightUpdater.init_weights_update_group`` and
    ``receive_weights_from_distributed``, executed from the wheel's source on an object that
    has just the attributes they read (``tp_rank``, ``device``, ``_model_update_group``)."""

    def __init__(self, tp_rank: int, device: str = "cpu") -> None:
        self.tp_rank = tp_rank
        self.device = device
        self._model_update_group: dict = {}

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _methods(cls) -> dict:
        import torch
        from sglang.srt.utils.common import init_custom_process_group
        from sglang.srt.utils.network import NetworkAddress

        updater = _class_defs(WEIGHT_UPDATER)["WeightUpdater"]
        fns = {n.name: n for n in updater.body if isinstance(n, ast.FunctionDef)}
        wanted = ["init_weights_update_group", "receive_weights_from_distributed"]
        ns = {"torch": torch, "init_custom_process_group": init_custom_process_group,
              "NetworkAddress": NetworkAddress, "logger": logging.getLogger("sglang.weight_updater"),
              "Optional": typing.Optional, "WeightUpdater": cls, "__name__": "sglang_weight_updater"}
        for name in wanted:
            fn = fns[name]
            fn.decorator_list = []
            code = compile(ast.Module(body=[fn], type_ignores=[]), source_path(WEIGHT_UPDATER), "exec",
                           flags=__future__.annotations.compiler_flag, dont_inherit=True)
            exec(code, ns)
        return {name: ns[name] for name in wanted}

    def init_weights_update_group(self, *args, **kwargs):
        return self._methods()["init_weights_update_group"](self, *args, **kwargs)

    def receive_weights_from_distributed(self, **kwargs):
        return self._methods()["receive_weights_from_distributed"](self, **kwargs)


# -- methods of a class, from the wheel's source ----------------------------------------------
def method(module: str, class_name: str, name: str, ns: dict):
    """The method ``name`` of ``class_name`` in a wheel module, executed from its source in
    ``ns`` (decorators dropped, annotations left unevaluated), as a plain function."""
    import copy

    fns = [n for n in _class_defs(module)[class_name].body
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    assert len(fns) == 1, f"{module}.{class_name}.{name}: {len(fns)} definitions"
    fn = copy.deepcopy(fns[0])
    fn.decorator_list = []
    exec(compile(ast.Module(body=[fn], type_ignores=[]), source_path(module), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns.pop(name)


def module_level(module: str, names: list[str], ns: dict) -> dict:
    """The module-level functions, classes and assignments ``names`` of a wheel module,
    executed from its source in ``ns`` (in source order; decorators dropped)."""
    import copy

    nodes = []
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            node = copy.deepcopy(node)
            node.decorator_list = []
        elif not (isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) in names for t in node.targets)):
            continue
        nodes.append(node)
    exec(compile(ast.Module(body=nodes, type_ignores=[]), source_path(module), "exec",
                 dont_inherit=True), ns)
    missing = [n for n in names if n not in ns]
    assert not missing, f"{module}: no {missing}"
    return ns


def defines(module: str, class_name: str, name: str) -> bool:
    """Whether ``class_name`` in a wheel module defines a method ``name`` itself."""
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               for n in _class_defs(module)[class_name].body)


def base_names(module: str, class_name: str) -> list[str]:
    return [ast.unparse(b) for b in _class_defs(module)[class_name].bases]


# -- SGLang's Qwen2 model: its parameters and its loader (models/qwen2.py) -----------------------
QWEN2 = "sglang.srt.models.qwen2"

# Layers that own parameters, and those they own (biases only where the call sets bias=True).
_LEAF_LAYERS = {"QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear",
                "ColumnParallelLinear", "RMSNorm", "VocabParallelEmbedding", "ParallelLMHead"}
# Calls in the models' __init__ whose result owns no parameter: activations, rotary
# embeddings (buffers), attention backends (unquantised: no scales), helpers that hold
# references to layers above (``DualGemm``, ``append_stages``), placeholders for other
# pipeline ranks, plain values.
_NO_PARAMETERS = {"SiluAndMul", "DualGemm", "DenseSiluAndMulQuant", "get_rope", "RadixAttention",
                  "append_stages", "resolve_linear_parallel_group", "PPMissingLayer",
                  "LogitsProcessor", "Pooler", "max", "getattr"}


def init_assignments(module: str, class_name: str) -> tuple[dict[str, list[ast.expr]], ast.FunctionDef]:
    """``self.<attr> = <value>`` in the class's ``__init__`` (every branch): attr -> values.
    Of a tuple target (``self.layers, self.start_layer, self.end_layer = make_pp_layers(...)``)
    the first element gets the value, the others hold what the call returns beside it."""
    init = next(n for n in _class_defs(module)[class_name].body
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(init):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            elts = target.elts[:1] if isinstance(target, ast.Tuple) else [target]
            for e in elts:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.setdefault(e.attr, []).append(node.value)
    return out, init


def model_param_names(module: str, class_name: str, num_layers: int, tied: bool,
                      prefix: str = "") -> list[str]:
    """The parameter names of an SGLang model class on one rank (no tensor or pipeline
    parallelism, unquantised), read from the submodules its ``__init__`` builds. A call not
    known to own parameters or not to own any fails, so a later pin's new layer is noticed."""
    assigned, init = init_assignments(module, class_name)
    classes = _class_defs(module)
    names: list[str] = []
    for attr, values in assigned.items():
        if tied and any(isinstance(v, ast.Attribute) and ast.unparse(v).startswith("self.") for v in values):
            continue  # tied: an alias of a module above (lm_head = self.model.embed_tokens)
        for call in (v for v in values if isinstance(v, ast.Call) and isinstance(v.func, ast.Name)):
            ctor = call.func.id
            if ctor in _LEAF_LAYERS:
                kw = {k.arg: k.value for k in call.keywords}
                names.append(f"{prefix}{attr}.weight")
                if ctor.endswith("Linear"):
                    assert "bias" in kw, f"{class_name}.{attr}: {ctor} without an explicit bias"
                    if ast.literal_eval(kw["bias"]):
                        names.append(f"{prefix}{attr}.bias")
            elif ctor == "make_pp_layers":  # layer i of the class given as decoder_layer_type
                args = init.args
                defaults = dict(zip([a.arg for a in args.args][-len(args.defaults):], args.defaults))
                layer = ast.unparse(defaults["decoder_layer_type"])
                for i in range(num_layers):
                    names += model_param_names(module, layer, num_layers, tied, f"{prefix}{attr}.{i}.")
            elif ctor in classes:
                names += model_param_names(module, ctor, num_layers, tied, f"{prefix}{attr}.")
            else:
                assert ctor in _NO_PARAMETERS, (f"{class_name}.{attr} = {ctor}(...): not known to own "
                                                f"parameters or not; teach tests/support/sglang_release.py")
    return names


class Qwen2Loader:
    """SGLang's ``Qwen2ForCausalLM._legacy_load_weights``, executed from the wheel's source on
    a stand-in model with the parameters ``param_names``; ``load(names)`` answers which
    parameter (and shard) each pushed name was loaded into, and the names it warned about."""

    def __init__(self, param_names: list[str], num_layers: int, tied: bool) -> None:
        from types import SimpleNamespace

        from sglang.srt.layers.utils.common import get_layer_id

        self.loaded: dict[str, tuple[str, object]] = {}
        self.warned: list[str] = []
        loaded = self.loaded

        class Param:
            def __init__(self, name: str) -> None:
                self.name = name

            def weight_loader(self, param, loaded_weight, shard_id=None):
                loaded[loaded_weight] = (param.name, shard_id)  # the tensor is the pushed name

        params = [(n, Param(n)) for n in param_names]
        self.model = SimpleNamespace(
            named_parameters=lambda: iter(params), config=SimpleNamespace(tie_word_embeddings=tied),
            pp_group=SimpleNamespace(is_last_rank=True),
            model=SimpleNamespace(start_layer=0, end_layer=num_layers))
        log = SimpleNamespace(warning=self.warned.append)
        ns = {"get_layer_id": get_layer_id, "logger": log, "__name__": "sglang_qwen2_loader",
              "default_weight_loader": lambda p, w: Param.weight_loader(p, p, w)}
        self._load = method(QWEN2, "Qwen2ForCausalLM", "_legacy_load_weights", ns)

    def load(self, names: list[str]) -> tuple[dict[str, tuple[str, object]], list[str]]:
        self.loaded.clear()
        self.warned.clear()
        self._load(self.model, [(n, n) for n in names])
        return dict(self.loaded), list(self.warned)
