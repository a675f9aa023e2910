"""Job backends: the one job protocol, local processes and their daemon, the SageMaker emulator, SageMaker itself, the
code a job's source ships, and a role per run."""

if __name__ != "hlat.infra.backends":  # pyproject.toml maps infra/ to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra.backends (`pip install -e .`)")
