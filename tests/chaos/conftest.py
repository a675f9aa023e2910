"""The chaos tests' fixtures: the integration tests' moto S3 server (a run on S3)."""

from tests.integration.conftest import s3_env, s3_server

__all__ = ["s3_env", "s3_server"]
