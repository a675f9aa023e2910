"""The control plane: job backends (local processes, the SageMaker emulator, SageMaker), the supervisor, the
planner, the instance catalog and AWS. Imports neither torch nor Prefect."""

if __name__ != "hlat.infra":  # one identity per module: pyproject.toml maps this folder to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra (`pip install -e .` maps it there)")
