"""The data-source checks of every run: the corpus, tokenizer and init weights can be read.

`source_findings` gives one `Finding` per source. For a SageMaker run a hub that does not answer from here is
unchecked, not failed; the job reaches it from AWS. A missing name always fails.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from hlat.core.config import ConfigError, DataConfig, HlatConfig
from hlat.core.storage import StorageError
from hlat.infra.checks.aws_clients import DENIED, boto_session, client_config, error_code, error_message
from hlat.infra.checks.findings import Finding
from hlat.infra.inputs.init_from import peek
from hlat.infra.inputs.tokenizer import HubUnreachable, fetch_pretrained

SourceShape = Callable[[DataConfig], str]
"""Checks data.source's shape without reading it and returns its kind: 'builtin', 'local', 's3' or 'hub'. The flows hand
in training/data/sources.py's functions, which this layer cannot import."""


def source_findings(config: HlatConfig, shape: SourceShape) -> list[Finding]:
    """Whether each corpus source can be read; a data.sources entry's findings name it."""
    findings = []
    for source in config.data.mixture:
        found = _one_source(config.data.source_data_config(source), shape, config.job.backend)
        if config.data.sources:
            named = f"data.sources[{source.resolved_name}]"
            found = Finding(found.check, found.ok, found.message.replace("data.source:", f"{named}:"), found.checked)
        findings.append(found)
    if config.tokenizer.pretrained is not None:
        findings.append(tokenizer_finding(config.tokenizer.pretrained, config.job.backend))
    if config.model.init_from is not None:
        findings.append(init_from_finding(config.model.init_from, config.job.backend))
    return findings


def _fetched(check: str, source: str, backend: str, describe: Callable[[], str]) -> Finding:
    """The finding of a check that fetches `source`; `describe` gives the success line. For SageMaker runs an
    unreachable hub is unchecked, not failed; a missing name fails."""
    try:
        return Finding(check, True, describe())
    except HubUnreachable as exc:
        if backend == "sagemaker":
            return Finding(check, True, f"{source}: the hub does not answer from here", checked=False)
        return Finding(check, False, str(exc))
    except (ValueError, StorageError) as exc:
        return Finding(check, False, str(exc))


def tokenizer_finding(source: str, backend: str = "local") -> Finding:
    """Whether tokenizer.pretrained can be fetched: its files are copied as the tokenizer stage will copy them."""

    def describe() -> str:
        with tempfile.TemporaryDirectory(prefix="hlat-preflight-tokenizer-") as tmp:
            info = fetch_pretrained(source, tmp)
        revision = f" at {info['revision']}" if info["revision"] else ""
        return f"{source}{revision}: {', '.join(info['names'])}"

    return _fetched("tokenizer", source, backend, describe)


def init_from_finding(source: str, backend: str = "local") -> Finding:
    """Whether model.init_from can be imported, judged from its small files (infra/inputs/init_from.py `peek`)."""
    return _fetched("init_from", source, backend, lambda: peek(source))


def _one_source(data: DataConfig, shape: SourceShape, backend: str) -> Finding:
    src = data.source
    try:
        kind = shape(data)  # its shape; a local path's existence
    except ConfigError as exc:
        return Finding("source", False, str(exc))
    if kind == "s3":
        return _s3_source(src)
    if kind == "hub":
        return _hub_source(data, backend)
    return Finding("source", True, f"{src} ({kind})")


def _s3_source(uri: str) -> Finding:
    bucket, _, key = uri[len("s3://") :].partition("/")
    s3 = boto_session(None).client("s3", config=client_config())
    try:
        if key and not key.endswith("/"):
            try:
                s3.head_object(Bucket=bucket, Key=key)
                return Finding("source", True, f"{uri} (an object)")
            except ClientError as exc:
                if error_code(exc) not in ("404", "NoSuchKey", "NotFound"):
                    raise
        prefix = key.rstrip("/") + "/" if key else ""
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        if listed.get("KeyCount", 0):
            return Finding("source", True, f"{uri} (a prefix)")
        return Finding(
            "source", False, f"data.source: nothing at or under {uri}; give an s3:// URI that holds the corpus"
        )
    except NoCredentialsError:
        return Finding(
            "source",
            False,
            f"data.source: {uri} cannot be read: no AWS credentials; configure a profile or "
            "environment keys (or job.aws_credentials_block) that may read it",
        )
    except ClientError as exc:
        code = error_code(exc)
        if code == "NoSuchBucket":
            return Finding("source", False, f"data.source: bucket {bucket!r} does not exist; check the s3:// URI")
        if code in (*DENIED, "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return Finding(
                "source",
                False,
                f"data.source: {uri} cannot be read ({code}); the caller needs s3:GetObject and "
                f"s3:ListBucket on arn:aws:s3:::{bucket}",
            )
        return Finding("source", False, f"data.source: {uri} cannot be read: {code}: {error_message(exc)}")
    except BotoCoreError as exc:
        return Finding("source", False, f"data.source: {uri} cannot be read: {type(exc).__name__}: {exc}")


def hub_cached(name: str) -> Path | None:
    """A local copy of hub dataset `name` (the datasets cache's or the hub cache's), or None."""
    datasets_cache = Path(
        os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
    )  # datasets' own default
    candidates = [
        datasets_cache / name.replace("/", "___"),
        Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}",
    ]
    return next((p for p in candidates if p.is_dir()), None)


def _hub_source(d: DataConfig, backend: str) -> Finding:
    name, cached = d.source, hub_cached(d.source)
    if constants.HF_HUB_OFFLINE:
        if cached is not None:
            return Finding("source", True, f"{name}: offline (HF_HUB_OFFLINE=1), its cached copy at {cached}")
        return Finding(
            "source",
            False,
            f"data.source: {name!r} cannot be resolved offline (HF_HUB_OFFLINE=1) and has no cached "
            "copy; unset HF_HUB_OFFLINE to reach the hub, or copy the data set to s3:// or a local folder",
        )
    try:
        HfApi(endpoint=constants.ENDPOINT).dataset_info(name, revision=d.revision, timeout=10)
        return Finding("source", True, f"{name} (the Hugging Face hub knows it)")
    except GatedRepoError:
        return Finding(
            "source",
            False,
            f"data.source: {name!r} is gated on the Hugging Face hub; accept its terms on the hub and set HF_TOKEN",
        )
    except RevisionNotFoundError:
        return Finding("source", False, f"data.revision: {d.revision!r} is not a revision of {name!r}; fix or unset it")
    except RepositoryNotFoundError:
        return Finding(
            "source",
            False,
            f"data.source: no Hugging Face dataset named {name!r} (or it is private: set HF_TOKEN); "
            "check the name (namespace/name)",
        )
    except Exception as exc:  # no answer: the network, a proxy, the endpoint
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]
        if cached is not None:
            return Finding("source", True, f"{name}: the hub does not answer ({why}); its cached copy at {cached}")
        if backend == "sagemaker":  # the job reaches the hub from AWS, not from here
            return Finding("source", True, f"{name}: the hub does not answer from here ({why})", checked=False)
        return Finding(
            "source",
            False,
            f"data.source: cannot reach the Hugging Face hub for {name!r} ({why}) and no cached copy; "
            "check the network or HF_ENDPOINT, or copy the data set to s3:// or a local folder",
        )
