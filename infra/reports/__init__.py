"""What a run reports: the evaluation report and the comparison of runs."""

if __name__ != "hlat.infra.reports":  # pyproject.toml maps infra/ to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra.reports (`pip install -e .`)")
