"""What a run costs and how to lay it out: the instance catalog, prices, estimates, the budget, the planner."""

if __name__ != "hlat.infra.cost":  # pyproject.toml maps infra/ to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra.cost (`pip install -e .`)")
