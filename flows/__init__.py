"""Thin Prefect flows chaining the tasks of each stage, and the parent flow `hlat` (the CLI is `hlat/cli.py`).

Importing `hlat.tasks` first sets the environment Prefect reads when it loads (tasks/__init__.py), once for both."""

import hlat.tasks  # noqa: F401

if __name__ != "hlat.flows":  # one identity per module: pyproject.toml maps this folder to hlat.flows
    raise ImportError(f"{__name__}: import this folder as hlat.flows (`pip install -e .` maps it there)")
