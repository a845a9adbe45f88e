"""``rl.log``: one format on stdout, the level from the config, Hydra's handlers replaced."""

from __future__ import annotations

import logging
import sys

import pytest

from rl.log import LEVEL_ENV, setup_logging, setup_worker_logging


@pytest.fixture
def root():
    """The root logger, restored after the test (pytest's own capture handlers included)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_lines_go_to_stdout_in_one_format_at_the_level(root, capsys):
    setup_logging("WARNING")
    logging.getLogger("rl.driver.cluster").info("not shown")
    logging.getLogger("rl.driver.cluster").warning("engine-%d died", 1)
    out = capsys.readouterr()
    assert out.err == ""
    assert out.out.endswith(" WARNING rl.driver.cluster: engine-1 died\n") and "not shown" not in out.out
    assert len(out.out.split(" ")[0]) == len("HH:MM:SS")


def test_a_console_handler_is_replaced_and_a_file_handler_kept_in_the_same_format(root, tmp_path, capsys):
    hydra_console = logging.StreamHandler(sys.stdout)  # what Hydra's job logging installs
    hydra_file = logging.FileHandler(tmp_path / "train.log")
    root.handlers[:] = [hydra_console, hydra_file]
    setup_logging("INFO")
    setup_logging("INFO")  # a second call replaces its own handler, not adds one
    logging.getLogger("rl.driver.run").info("checkpoint %s", "step_000002")
    hydra_file.flush()
    assert hydra_console not in root.handlers and hydra_file in root.handlers and len(root.handlers) == 2
    printed = capsys.readouterr().out
    assert printed.count("INFO rl.driver.run: checkpoint step_000002") == 1
    assert (tmp_path / "train.log").read_text() == printed


def test_a_ray_worker_takes_the_level_from_the_environment(root, monkeypatch):
    monkeypatch.setenv(LEVEL_ENV, "ERROR")
    setup_worker_logging()
    assert root.level == logging.ERROR
