"""What is checked before money is spent: the live preflight, the requests' preflight, the run's AWS credentials."""

if __name__ != "hlat.infra.checks":  # pyproject.toml maps infra/ to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra.checks (`pip install -e .`)")
