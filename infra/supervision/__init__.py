"""Keeping a stage's jobs going: the supervisor, its ledger, lease and progress, and `hlat status` / `hlat stop`."""

if __name__ != "hlat.infra.supervision":  # pyproject.toml maps infra/ to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra.supervision (`pip install -e .`)")
