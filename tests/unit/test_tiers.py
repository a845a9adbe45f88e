"""The test tree's own rules: every test module sits in one of the three tiers, each tier
folder has its own conftest, and no module under tests/ imports a test module or a conftest
(what tests share lives in tests/support/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.env import REPO

TESTS = Path(REPO) / "tests"
TIERS = ("unit", "integration", "e2e")
IMPORT_IN_CODE = re.compile(r"\b(?:from|import)\s+(tests(?:\.\w+)+)")
"""An import in a string: code that a test runs in another interpreter."""


def _forbidden(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def imports_of_tests(source: str, module: str) -> list[str]:
    """What the source of ``module`` (dotted, e.g. ``tests.unit.test_x``) imports of a test
    module or a conftest: ``import``, ``from ... import`` (relative too; ``from a import b``
    imports the module ``a.b`` when ``a`` is a package) and imports written in strings."""
    package = module.rsplit(".", 1)[0].split(".")
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [base]
            if Path(REPO, *base.split(".")).is_dir():  # a package: ``from tests import test_x``
                names += [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = IMPORT_IN_CODE.findall(node.value)
        found += [f"line {node.lineno}: {n}" for n in names if _forbidden(n)]
    return found


def test_the_check_finds_every_way_of_importing_a_test_module():
    sources = {
        "from tests.unit.test_learner import make_batch": "tests.unit.test_learner",
        "from tests.integration import test_async": "tests.integration.test_async",
        "import tests.conftest": "tests.conftest",
        "from . import conftest": "tests.unit.conftest",
        "from .test_codec import assert_same": "tests.unit.test_codec",
        "code = 'import sys; from tests.conftest import compose'": "tests.conftest",
    }
    for source, name in sources.items():
        assert imports_of_tests(source, "tests.unit.test_x") == [f"line 1: {name}"], source
    allowed = ("from tests.support.batches import make_batch\nimport tests.support.env\n"
               "from tests.support import sglang_release\n"
               "target = 'task.reward._target_=tests.support.helpers.length_reward'")
    assert imports_of_tests(allowed, "tests.unit.test_x") == []


def test_no_module_under_tests_imports_a_test_module_or_a_conftest():
    found = []
    for path in sorted(set(TESTS.rglob("*.py")) - {Path(__file__)}):  # not this file's examples
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found += [f"{path.relative_to(REPO)} {hit}" for hit in imports_of_tests(path.read_text(), module)]
    assert not found, "move what they share into tests/support/:\n" + "\n".join(found)


def test_every_test_module_is_in_a_tier_with_its_own_conftest():
    for tier in TIERS:
        assert (TESTS / tier / "conftest.py").is_file(), tier
    outside = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
               if p.relative_to(TESTS).parts[0] not in TIERS]
    assert not outside, outside
    assert not (TESTS / "conftest.py").exists()  # each tier picks its fixtures from tests/support
