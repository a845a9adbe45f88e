"""Every tensor handed to a ``torch.distributed`` collective in ``rl/`` is made on a device
named where it is made.

NCCL serves CUDA tensors only (``Backend.backend_capability``): a metric reduction over a
tensor left on the CPU raises "No backend type associated with device type cpu" at the
first training step of every GPU run, while gloo on this machine takes it without a word.
No CPU run can tell "on the learner's device" from "on the CPU", so this is a static check:
the tensor argument of each collective call must be a name bound, in the same function, to a
tensor factory called with ``device=<x>.device`` (or a variable ``device``) or to a move
``.to(<x>.device)``; a literal device ("cpu") or a dtype-only ``.to`` does not count. The GPU tests
(``tests/integration/test_gpu.py``) run the same learner code over real NCCL.
"""

from __future__ import annotations

import ast
import os
import textwrap

from tests.support.env import REPO

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


def _is_the_device(node: ast.expr | None) -> bool:
    """``self.device`` (or any ``<x>.device``) or a variable named ``device``: the device of
    the group's rank, never a literal such as "cpu" and never a dtype."""
    return (isinstance(node, ast.Attribute) and node.attr == "device") or (
        isinstance(node, ast.Name) and node.id == "device")


def _made_on_a_device(value: ast.expr) -> bool:
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return False
    device = next((k.value for k in value.keywords if k.arg == "device"), None)
    if value.func.attr == "to":
        return _is_the_device(device if device is not None else (value.args[0] if value.args else None))
    return value.func.attr in FACTORIES and _is_the_device(device)


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
                found.append(f"{where}: {arg.id} is not made on the rank's device (device=<x>.device "
                             f"or .to(<x>.device); NCCL refuses CPU tensors)")
    return found


def test_the_check_finds_a_cpu_tensor_handed_to_a_collective():
    """The defect this guards against, as the learner had it: a metric reduction over a
    tensor made without a device."""
    bad = textwrap.dedent("""
        def train(self):
            trained = torch.tensor([1.0], dtype=torch.float64)
            dist.all_reduce(trained)
            torch.distributed.broadcast(self.buffer, src=0)
            on_cpu = torch.tensor([1.0], device="cpu")
            dist.all_reduce(on_cpu)
            wide = x.to(torch.float64)
            dist.all_reduce(wide)
            moved = x.to("cpu")
            dist.all_reduce(moved)
        """)
    good = textwrap.dedent("""
        def train(self):
            t = torch.tensor([1.0], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            moved = x.to(self.device)
            dist.broadcast(moved, src=0)
        """)
    found = offending_calls(bad, "bad.py")
    assert len(found) == 5
    assert "bad.py:4: dist.all_reduce: trained is not made on the rank's device" in found[0]
    assert [f.split(":")[1] for f in found] == ["4", "5", "7", "9", "11"]
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
