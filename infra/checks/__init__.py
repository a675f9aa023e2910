"""What is checked before money is spent: the live preflight, the requests' preflight, the run's AWS credentials.

`preflight.py` runs the checks and remembers what passed. Each concern is one module: `sources.py` (data source,
tokenizer, init weights), `iam.py` (role, trust, PassRole), `storage_probe.py`, `images.py`, `capacity.py` (quotas,
training plan). They share `findings.py` and `aws_clients.py`. `requests.py` checks a run's job requests and spend
before anything is written; `aws.py` holds a run's credentials.
"""

if __name__ != "hlat.infra.checks":  # pyproject.toml maps infra/ to hlat.infra
    raise ImportError(f"{__name__}: import this folder as hlat.infra.checks (`pip install -e .`)")
