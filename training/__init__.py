"""What runs inside a job: the job programs (`python -m hlat.training.<program>`) and their libraries. Imports no
Prefect."""

if __name__ != "hlat.training":  # one identity per module: pyproject.toml maps this folder to hlat.training
    raise ImportError(f"{__name__}: import this folder as hlat.training (`pip install -e .` maps it there)")
