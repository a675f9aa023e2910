"""What a run is given before its jobs: the tokenizer and the weights it starts from."""

if __name__ != "hlat.infra.inputs":  # pyproject.toml maps infra/ to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra.inputs (`pip install -e .`)")
