"""The dry run checks its requests against botocore's SageMaker service model (enums, patterns, lengths, ranges),
prices only what it knows, and says how a training longer than one job's max runtime is chained."""

from __future__ import annotations

from pathlib import Path

import botocore.session
import pytest
from botocore.validate import ParamValidator

from hlat.core.presets import load_config
from hlat.infra.backends.protocol import Action, JobState, Status, classify
from hlat.infra.backends.sagemaker_validation import check_request, request_problems, sagemaker_service_model
from hlat.infra.checks.requests import preflight
from hlat.infra.dry_run import PLACEHOLDER_ROLE, dry_run

ROLE = "arn:aws:iam::111122223333:role/hlat-training"
ROOT = "s3://hlat-runs/prod"


def sagemaker(preset: str = "hlat-7b", **overrides: object) -> object:
    return load_config(preset, {"job.role_arn": ROLE, **overrides}, storage=ROOT)


def test_the_checks_are_the_service_models_own_and_go_beyond_botocores() -> None:
    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.operation_model("CreateTrainingJob").input_shape
    instance_types = shape.members["ResourceConfig"].members["InstanceType"].enum
    assert sagemaker_service_model().operation_model("CreateTrainingJob").input_shape.members.keys() == (
        shape.members.keys()
    )
    request = {
        "TrainingJobName": "r1-train-1",
        "RoleArn": ROLE,
        "OutputDataConfig": {"S3OutputPath": f"{ROOT}/r1/out"},
        "ResourceConfig": {"InstanceType": "ml.trn1.32xlarg", "InstanceCount": 1, "VolumeSizeInGB": 512},
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
    }
    # botocore's client-side validation lets the misspelt enum through: SageMaker would refuse it after the upload.
    assert not ParamValidator().validate(request, shape).has_errors()
    [(path, problem)] = request_problems("CreateTrainingJob", request)
    assert path == "ResourceConfig.InstanceType" and "did you mean 'ml.trn1.32xlarge'" in problem
    # Every value of the model's enum is accepted, none other; lengths are the model's limits.
    for value in instance_types:
        ok = {**request, "ResourceConfig": {**request["ResourceConfig"], "InstanceType": value}}
        assert request_problems("CreateTrainingJob", ok) == []
    name_max = shape.members["TrainingJobName"].metadata["max"]
    long_name = {**request, "TrainingJobName": "r" * (name_max + 1), "ResourceConfig": {"InstanceCount": 1}}
    problems = request_problems("CreateTrainingJob", long_name)
    assert {p for p, _ in problems} == {"TrainingJobName"}
    assert f"has {name_max + 1} characters, more than SageMaker's limit of {name_max}" in problems[0][1]
    # Patterns, numeric minimums and required members (this last one only for a whole request).
    bad = {"TrainingJobName": "no_underscores", "StoppingCondition": {"MaxRuntimeInSeconds": 0}}
    paths = [p for p, _ in request_problems("CreateTrainingJob", bad)]
    assert paths == ["RoleArn", "OutputDataConfig", "TrainingJobName", "StoppingCondition.MaxRuntimeInSeconds"]
    assert [p for p, _ in request_problems("CreateTrainingJob", bad, partial=True)] == paths[2:]


def test_a_misspelt_instance_type_fails_the_dry_run_naming_the_field_and_the_allowed_values() -> None:
    with pytest.raises(ValueError) as raised:
        dry_run(sagemaker(**{"job.instance_type": "ml.trn1.32xlarg"}))
    message = str(raised.value)
    assert message.startswith("SageMaker would refuse this job: job.instance_type: ")
    assert "ml.trn1.2xlarge, ml.trn1.32xlarge, ml.trn1n.32xlarge" in message
    assert "did you mean 'ml.trn1.32xlarge'?" in message
    # The evaluation job's own instance type is its own setting.
    with pytest.raises(ValueError, match=r"evaluation\.instance_type: .*did you mean 'ml.p4d.24xlarge'"):
        dry_run(sagemaker(**{"evaluation.instance_type": "ml.p4d.24xlarg"}), stage="evaluate")


def test_a_storage_root_too_long_for_sagemakers_uris_names_storage_root_and_the_limit() -> None:
    config = load_config("hlat-7b", {"job.role_arn": ROLE}, storage="s3://hlat-runs/" + "p" * 1000)
    with pytest.raises(
        ValueError, match=r"storage\.root .*has 1,0\d\d characters, more than SageMaker's limit of 1,024"
    ):
        dry_run(config)
    assert "limit" not in dry_run(load_config("hlat-7b", {"job.role_arn": ROLE}, storage="s3://b/" + "p" * 400))


def test_a_bare_role_name_is_refused_and_the_placeholder_role_stays_for_the_dry_run() -> None:
    with pytest.raises(ValueError) as raised:
        dry_run(sagemaker(**{"job.role_arn": "hlat-training"}))
    message = str(raised.value)
    assert "job.role_arn: " in message and "'hlat-training' is not an IAM role ARN" in message
    assert "arn:aws:iam::<account>:role/<name>" in message and "job.role_arn_secret" in message
    assert "123456789012" not in message
    text = dry_run(load_config("hlat-7b", storage=ROOT))
    assert f"placeholder: job.role_arn is not set; shown with {PLACEHOLDER_ROLE}" in text
    assert f'"RoleArn": "{PLACEHOLDER_ROLE}"' in text


def test_an_instance_type_without_a_price_is_not_priced_at_zero() -> None:
    text = dry_run(sagemaker(**{"job.instance_type": "ml.m5.xlarge"}))
    assert "$0.00" not in text
    assert "ml.m5.xlarge: no price in the instance catalog" in text and "job.price_per_hour_usd" in text
    priced = dry_run(sagemaker(**{"job.instance_type": "ml.m5.xlarge", "job.price_per_hour_usd": 0.23}))
    assert "64 x ml.m5.xlarge at $0.230/node-hour = $14.72/hour" in priced


def test_the_real_submit_checks_before_any_stage_runs(tmp_path: Path) -> None:
    from hlat.flows.stage import resolve

    typo = {"job.role_arn": ROLE, "job.instance_type": "ml.trn1.32xlarg"}
    with pytest.raises(ValueError, match=r"job\.instance_type: .*did you mean"):
        preflight(load_config("hlat-7b", typo, storage=ROOT))
    # A flow run resolves its config first: the typo stops it there, before config.json or any data stage.
    with pytest.raises(ValueError, match=r"job\.instance_type: .*did you mean"):
        resolve("hlat-7b", typo, "r1", ROOT)
    with pytest.raises(ValueError, match=r"evaluation\.instance_type"):
        preflight(sagemaker(**{"evaluation.instance_type": "ml.p4d.24xlarg"}))
    preflight(load_config("hlat-7b", storage=ROOT))  # no role yet: the Secret block may give it later
    preflight(load_config("tiny", storage=str(tmp_path)))  # a local run has nothing to check


def test_a_training_past_the_28_day_cap_says_how_its_jobs_are_chained() -> None:
    text = dry_run(sagemaker("hlat-70b"))
    assert "46.1 days" in text  # the planner's figure for HLAT's layout (TP32 PP8) on 256 nodes
    assert (
        "chaining: 46.1 days > 28-day max runtime (SageMaker's 28-day cap): 2 jobs of at most "
        "MaxRuntimeInSeconds=2,419,200, each resuming from the newest checkpoint (every 300 steps)"
    ) in text
    assert '"MaxRuntimeInSeconds": 2419200' in text
    # ... which is what the supervisor does with a job SageMaker stopped at its max runtime: relaunch at once.
    stopped = JobState("r1-train-1", Status.STOPPED, None, "MaxRuntimeExceeded", 2_419_200.0, 256)
    assert classify(stopped).action == Action.RESUME
    assert "chaining" not in dry_run(sagemaker("hlat-7b"))  # 17.8 days: one job
    shorter = dry_run(sagemaker("hlat-7b", **{"job.max_runtime_hours": 100, "job.max_restarts": 3}))
    assert "17.8 days > 4.16667-day max runtime (job.max_runtime_hours): 5 jobs" in shorter
    assert "4 relaunches and job.max_restarts is 3" in shorter


def test_a_whole_request_is_checked_before_it_is_sent() -> None:
    with pytest.raises(ValueError, match=r"TrainingJobName"):
        check_request("CreateTrainingJob", {"TrainingJobName": "x" * 64})


def test_the_dry_run_of_training_and_of_prepare_data_shows_the_tokens_drawn_from_each_source() -> None:
    sources = [
        {"name": "web", "source": "HuggingFaceFW/fineweb", "weight": 0.9, "tokens": 15_000_000_000_000},
        {"name": "wiki", "source": "wikimedia/wikipedia", "weight": 0.1},  # no declared size: epochs unknown
    ]
    config = sagemaker(**{"data.sources": sources})
    tokens = 429_000 * 1024 * 4096
    for stage in ("train", "prepare-data"):
        lines = dry_run(config, stage=stage).splitlines()
        head = lines.index("  source  share  tokens drawn       source tokens       epochs")
        assert lines[head + 1].split() == [
            "web", "90.0%", f"{round(0.9 * tokens):,}", "15,000,000,000,000", f"{0.9 * tokens / 15e12:.2f}", "(max",
            "4)",
        ]  # fmt: skip
        assert lines[head + 2].split() == ["wiki", "10.0%", f"{round(0.1 * tokens):,}", "unknown", "?", "(max", "4)"]
    # The evaluation job draws no training tokens: no table.
    assert "tokens drawn" not in dry_run(config, stage="evaluate")
