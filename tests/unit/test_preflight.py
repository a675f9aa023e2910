"""The preflight's own logic, without AWS: PassRole evaluated from policy documents, a role's trust, the instances each
stage holds; and a default run extended in place (issue 40): a plain re-run continues it, and a config its
config.json refuses is refused before a server starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlat.core.config import ConfigError
from hlat.core.presets import load_config
from hlat.infra.preflight import _trusts_sagemaker, instance_needs, passrole_decision
from hlat.infra.runs import check_run, continued, open_run
from hlat.preflight_cli import check_before_start

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
    from hlat.infra.preflight import source_findings

    present = tmp_path / "books.jsonl"
    present.write_text('{"text": "a book"}\n')
    sources = [{"source": str(present)}, {"source": str(tmp_path / "missing.jsonl"), "name": "web"}]
    findings = source_findings(load_config("tiny", {"data.sources": sources}), source_shape)
    assert [f.ok for f in findings] == [True, False]
    assert findings[1].message.startswith("data.sources[web]: ") and "missing.jsonl" in findings[1].message
