"""The preflight's own logic, without AWS: PassRole evaluated from policy documents, a role's trust (with the
confused-deputy conditions AWS recommends), the instances each stage holds and those other runs' running jobs hold
(SageMaker's answers from botocore's Stubber, checked against its service model); and a default run extended in
place (issue 40): a plain re-run continues it, and a config its config.json refuses is refused before a server
starts."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from hlat.commands.preflight import check_before_start
from hlat.core.config import ConfigError
from hlat.core.presets import load_config
from hlat.core.run import check_run, continued, open_run
from hlat.infra.checks.capacity import instance_needs, instances_in_use, own_job_names
from hlat.infra.checks.iam import _trusts_sagemaker, passrole_decision

ROLE = "arn:aws:iam::123456789012:role/hlat-sagemaker"


def statement(**fields: object) -> dict[str, object]:
    return {"Version": "2012-10-17", "Statement": [fields]}


@pytest.mark.parametrize(
    ("documents", "allowed"),
    [
        ([statement(Effect="Allow", Action="*", Resource="*")], True),
        ([statement(Effect="Allow", Action="iam:Pass*", Resource="arn:aws:iam::123456789012:role/hlat-*")], True),
        ([statement(Effect="Allow", Action="iam:PassRole", Resource="arn:aws:iam::123456789012:role/other")], False),
        ([statement(Effect="Allow", NotAction="iam:PassRole", Resource="*")], False),
        ([statement(Effect="Allow", Action="*", Resource="*"),
          statement(Effect="Deny", Action="iam:*", Resource=ROLE)], False),
        ([statement(Effect="Allow", Action="*", NotResource=ROLE)], False),
        # The recommended statement: PassRole only to SageMaker.
        ([statement(Effect="Allow", Action="iam:PassRole", Resource=ROLE,
                    Condition={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}})], True),
        ([statement(Effect="Allow", Action="iam:PassRole", Resource=ROLE,
                    Condition={"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}})], False),
        # A condition only IAM can evaluate: not decided here.
        ([statement(Effect="Allow", Action="iam:PassRole", Resource=ROLE,
                    Condition={"IpAddress": {"aws:SourceIp": "10.0.0.0/8"}})], None),
        ([], False),
    ],
)  # fmt: skip
def test_passrole_is_decided_as_iam_decides_it(documents: list[dict[str, object]], allowed: bool | None) -> None:
    assert passrole_decision(documents, ROLE) is allowed


def test_a_role_trusts_sagemaker_only_through_an_allow_of_sts_assume_role() -> None:
    trusted = statement(Effect="Allow", Principal={"Service": ["sagemaker.amazonaws.com"]}, Action="sts:AssumeRole")
    assert _trusts_sagemaker(trusted)
    assert _trusts_sagemaker(json.dumps(trusted))  # as some IAM answers carry it: JSON text
    assert not _trusts_sagemaker(statement(Effect="Allow", Principal={"Service": "ec2.amazonaws.com"}, Action="*"))
    assert not _trusts_sagemaker(
        statement(Effect="Deny", Principal={"Service": "sagemaker.amazonaws.com"}, Action="sts:AssumeRole")
    )


def test_a_trust_guarded_by_the_source_account_trusts_sagemaker_for_that_account_only() -> None:
    """deployments/account.yaml's trust: SageMaker, with aws:SourceAccount the stack's account (before, any condition
    read as 'does not trust', so the template's own role failed the preflight)."""

    def assume(condition: dict[str, Any]) -> dict[str, Any]:
        sagemaker = {"Service": "sagemaker.amazonaws.com"}
        return statement(Effect="Allow", Principal=sagemaker, Action="sts:AssumeRole", Condition=condition)

    guarded = assume({"StringEquals": {"aws:SourceAccount": "123456789012"}})
    job = "arn:aws:sagemaker:us-west-2:123456789012:training-job/hlat-7b-1a2b-train-1"
    here = {"aws:sourceaccount": "123456789012", "aws:sourcearn": job}
    assert _trusts_sagemaker(guarded, here) is True
    assert _trusts_sagemaker(guarded, {**here, "aws:sourceaccount": "210987654321"}) is False
    by_arn = assume({"ArnLike": {"aws:SourceArn": "arn:aws:sagemaker:*:123456789012:training-job/*"}})
    assert _trusts_sagemaker(by_arn, here) is True
    assert _trusts_sagemaker(by_arn, {**here, "aws:sourcearn": job.replace("training-job", "endpoint")}) is False
    # A key only IAM knows the value of: not decided here.
    assert _trusts_sagemaker(assume({"StringEquals": {"aws:PrincipalTag/team": "ml"}}), here) is None


def test_the_runs_own_jobs_are_told_from_other_runs() -> None:
    own = own_job_names("hlat-7b-1a2b")
    assert (
        own("hlat-hlat-7b-1a2b-train-3")
        and own("hlat-hlat-7b-1a2b-evaluate-1")
        and own("hlat-hlat-7b-1a2b-prepare-data-12")
    )
    assert not own("hlat-hlat-7b-1a2b-c-train-3")  # another run whose id starts alike
    assert not own("hlat-hlat-7b-1a2b-train") and not own("hlat-hlat-70b-9f9f-train-1") and not own("someone-elses-job")


def _sagemaker_stub() -> tuple[Any, Stubber]:
    client = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def _described(name: str, status: str = "InProgress", **resources: Any) -> dict[str, Any]:
    """A DescribeTrainingJob answer with the fields the service model requires."""
    return {
        "TrainingJobName": name,
        "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}",
        "ModelArtifacts": {"S3ModelArtifacts": "s3://b/out"},
        "TrainingJobStatus": status,
        "SecondaryStatus": "Training",
        "AlgorithmSpecification": {"TrainingInputMode": "File"},
        "ResourceConfig": {"VolumeSizeInGB": 50, **resources},
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
        "CreationTime": datetime(2026, 1, 1, tzinfo=UTC),
    }


def _summary(name: str) -> dict[str, Any]:
    return {
        "TrainingJobName": name,
        "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}",
        "CreationTime": datetime(2026, 1, 1, tzinfo=UTC),
        "TrainingJobStatus": "InProgress",
    }


def test_the_instances_other_runs_jobs_hold_by_type_over_every_page() -> None:
    """Two pages of running jobs: a heterogeneous cluster (both instance groups count), this run's own job (not
    counted, not even described), a job that ended between the listing and its description (not counted)."""
    client, stub = _sagemaker_stub()
    stub.add_response(
        "list_training_jobs",
        {"TrainingJobSummaries": [_summary("a-train-1"), _summary("hlat-hlat-7b-1a2b-train-2")], "NextToken": "p2"},
        {"StatusEquals": "InProgress", "MaxResults": 100},
    )
    stub.add_response(
        "describe_training_job",
        _described("a-train-1", InstanceType="ml.trn1.32xlarge", InstanceCount=16),
        {"TrainingJobName": "a-train-1"},
    )
    stub.add_response(
        "list_training_jobs",
        {"TrainingJobSummaries": [_summary("b-hetero-1"), _summary("c-ended-1")]},
        {"StatusEquals": "InProgress", "MaxResults": 100, "NextToken": "p2"},
    )
    groups = [
        {"InstanceType": "ml.trn1.32xlarge", "InstanceCount": 4, "InstanceGroupName": "train"},
        {"InstanceType": "ml.c5.4xlarge", "InstanceCount": 2, "InstanceGroupName": "data"},
    ]
    stub.add_response("describe_training_job", _described("b-hetero-1", InstanceGroups=groups))
    stub.add_response(
        "describe_training_job",
        _described("c-ended-1", "Completed", InstanceType="ml.trn1.32xlarge", InstanceCount=64),
    )
    with stub:
        held = instances_in_use(client, own_job_names("hlat-7b-1a2b"))
    stub.assert_no_pending_responses()
    assert held == {
        "ml.trn1.32xlarge": [("a-train-1", 16), ("b-hetero-1", 4)],
        "ml.c5.4xlarge": [("b-hetero-1", 2)],
    }


def test_the_instances_each_stage_holds_at_once() -> None:
    config = load_config("hlat-7b", {"evaluation.instance_type": None, "evaluation.every_steps": 1000})
    # Evaluation every 1,000 steps runs beside the training, on the training's instance type.
    assert instance_needs(config) == {
        "ml.c5.4xlarge": (8, ["prepare-data"]),
        "ml.trn1.32xlarge": (65, ["precompile", "burn-in", "train", "evaluate beside train"]),
    }


# -- issue 40: extending the default run in place --------------------------------------------------------------
EXTEND = {"training.max_steps": 800, "training.schedule_steps": 600}


def test_a_plain_rerun_continues_a_default_run_extended_in_place(tmp_path: Path) -> None:
    storage = str(tmp_path / "runs")
    plain = load_config("tiny", storage=storage)
    default_id = plain.resolved_run_id()
    open_run(plain)
    extended = open_run(load_config("tiny", EXTEND, run_id=default_id, storage=storage))
    assert extended.load_config().training.max_steps == 800

    # Before the fix the plain re-run was refused: "use another run id ..., or none so that one is derived".
    again = continued(load_config("tiny", storage=storage))
    assert again.run_id == default_id and (again.training.max_steps, again.training.schedule_steps) == (800, 600)
    assert check_run(again).run_id == default_id
    assert open_run(again).load_config().training.max_steps == 800  # config.json keeps the extended length

    # Another config whose derived id was taken under --run-id gets the choice, not "or none".
    other = load_config("tiny", storage=str(tmp_path / "other"))
    open_run(load_config("tiny", {"training.lr": 3e-3}, run_id=other.resolved_run_id(), storage=other.storage.root))
    with pytest.raises(ConfigError, match="the id derived from this config, holds a run started with a different") as e:
        check_run(continued(other))
    assert "or give this config another run id" in str(e.value) and "or none so that" not in str(e.value)


def test_an_extension_that_changes_the_schedule_is_refused_before_a_server_starts(tmp_path: Path) -> None:
    storage = str(tmp_path / "runs")
    open_run(load_config("tiny", run_id="demo", storage=storage))
    stored = (tmp_path / "runs" / "demo" / "config.json").read_text()
    with pytest.raises(ConfigError) as refused:  # read from config.json, in the CLI's process: no server, no flow
        check_before_start(
            load_config("tiny", {"training.max_steps": 800}, run_id="demo", storage=storage), reads_source=True
        )
    assert "also set training.schedule_steps=600" in str(refused.value)
    assert (tmp_path / "runs" / "demo" / "config.json").read_text() == stored  # nothing written


def test_each_source_of_a_mixture_is_checked_and_named(tmp_path: Path) -> None:
    from hlat.core.presets import load_config
    from hlat.flows.stage import source_shape
    from hlat.infra.checks.sources import source_findings

    present = tmp_path / "books.jsonl"
    present.write_text('{"text": "a book"}\n')
    sources = [{"source": str(present)}, {"source": str(tmp_path / "missing.jsonl"), "name": "web"}]
    findings = source_findings(load_config("tiny", {"data.sources": sources}), source_shape)
    assert [f.ok for f in findings] == [True, False]
    assert findings[1].message.startswith("data.sources[web]: ") and "missing.jsonl" in findings[1].message
