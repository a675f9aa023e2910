"""The ground both the control plane (`infra/`) and the job programs (`training/`) stand on: the config schema and
presets, the run layout, the job contract and storage. Imports neither torch nor Prefect."""

if __name__ != "hlat.core":  # one identity per module: pyproject.toml maps this folder to hlat.core
    raise ImportError(f"{__name__}: import this folder as hlat.core (`pip install -e .` maps it there)")
