"""Every tensor handed to a ``torch.distributed`` collective in ``rl/`` is made on a device
named where it is made.

NCCL serves CUDA tensors only (``Backend.backend_capability``): a metric reduction over a
tensor left on the CPU raises "No backend type associated with device type cpu" at the
first training step of every GPU run, while gloo on this machine takes it without a word.
No CPU run can tell "on the learner's device" from "on the CPU", so this is a static check:
the tensor argument of each collective call must be a name bound, in the same function, to a
tensor factory called with ``device=`` or to a ``.to(...)`` move. The GPU tests
(``tests/test_gpu.py``) run the same learner code over real NCCL.
"""

from __future__ import annotations

import ast
import os
import textwrap

from tests.conftest import REPO

COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "scatter", "gather", "send", "recv", "isend", "irecv"}
"""``torch.distributed`` calls that hand a tensor to the backend (the ``*_object`` ones
pickle on the current device themselves)."""
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
             "ones_like", "empty_like", "full_like"}


def _is_dist(node: ast.expr) -> bool:
    """``dist`` or ``torch.distributed``."""
    return (isinstance(node, ast.Name) and node.id == "dist") or (
        isinstance(node, ast.Attribute) and node.attr == "distributed"
        and isinstance(node.value, ast.Name) and node.value.id == "torch")


def _made_on_a_device(value: ast.expr) -> bool:
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return False
    if value.func.attr == "to":
        return bool(value.args or value.keywords)
    return value.func.attr in FACTORIES and any(k.arg == "device" for k in value.keywords)


def offending_calls(source: str, filename: str) -> list[str]:
    """``file:line: why`` for each collective whose tensor is not made on a named device."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        bound: dict[str, list[ast.expr]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        bound.setdefault(target.id, []).append(node.value)
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in COLLECTIVES and _is_dist(call.func.value)):
                continue
            where = f"{filename}:{call.lineno}: dist.{call.func.attr}"
            arg = call.args[0] if call.args else None
            if not isinstance(arg, ast.Name) or arg.id not in bound:
                found.append(f"{where}: its tensor is not a name bound in {fn.name}(); "
                             f"make it there with device=")
            elif not all(_made_on_a_device(v) for v in bound[arg.id]):
                found.append(f"{where}: {arg.id} is made without device= (NCCL refuses CPU tensors)")
    return found


def test_the_check_finds_a_cpu_tensor_handed_to_a_collective():
    """The defect this guards against, as the learner had it: a metric reduction over a
    tensor made without a device."""
    bad = textwrap.dedent("""
        def train(self):
            trained = torch.tensor([1.0], dtype=torch.float64)
            dist.all_reduce(trained)
            torch.distributed.broadcast(self.buffer, src=0)
        """)
    good = textwrap.dedent("""
        def train(self):
            t = torch.tensor([1.0], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            moved = x.to(self.device)
            dist.broadcast(moved, src=0)
        """)
    found = offending_calls(bad, "bad.py")
    assert len(found) == 2 and "bad.py:4: dist.all_reduce: trained is made without device=" in found[0]
    assert "bad.py:5" in found[1]
    assert offending_calls(good, "good.py") == []


def test_every_collective_in_rl_gets_a_tensor_on_a_named_device():
    found, calls = [], 0
    for root, _, files in os.walk(os.path.join(REPO, "rl")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    source = f.read()
                found += offending_calls(source, os.path.relpath(path, REPO))
                calls += sum(f"dist.{c}(" in source for c in COLLECTIVES)
    assert calls > 0  # the learner's reductions are found at all
    assert found == [], "\n".join(found)
