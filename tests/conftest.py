"""This suite's own tests belong to this repository's sessions only.

A clone of the suite inside another project (a vendored copy, a submodule, a folder beside the
user's code) is not that project's tests: a session whose rootdir is not this repository (pytest
run in the user's project, ``pytest --fsdp-model ...`` from a folder that holds the clone) skips
everything in this folder, unless a path inside it was asked for on the command line. Run from
this repository (its ``pyproject.toml`` makes it the rootdir of any path inside it) they
collect as always.
"""

from __future__ import annotations

from pathlib import Path

import pytest

#: The repository these tests belong to.
REPOSITORY = Path(__file__).resolve().parent.parent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.rootpath.resolve() == REPOSITORY or _asked_for(config):
        return None
    return True


def _asked_for(config: pytest.Config) -> bool:
    """Whether a command-line path lies inside this folder (its tests were asked for)."""
    here = Path(__file__).resolve().parent
    start = config.invocation_params.dir
    for arg in config.invocation_params.args:
        if arg.startswith("-"):
            continue
        path = (start / arg.split("::", 1)[0]).resolve()
        if path == here or here in path.parents:
            return True
    return False
