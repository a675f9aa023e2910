"""Flow parameters as the UI renders them: a preset choice, typed override fields, a clear error for a
deployment placeholder that was never filled in."""

from __future__ import annotations

import inspect
from typing import get_args

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import ValidationError

from hlat.cli import _overrides, build_parser, flow_call
from hlat.core.config import ConfigError, HlatConfig, parse_override
from hlat.core.presets import PRESETS
from hlat.core.stages import STAGE_NAMES, stage
from hlat.flows.params import FORM_FIELDS, Overrides, PresetName, overrides_dict
from hlat.flows.pretrain import hlat, stage_flow_of
from hlat.flows.stage import resolve


def test_the_preset_choice_lists_every_preset() -> None:
    assert list(get_args(PresetName)) == list(PRESETS)


def test_form_fields_are_config_fields_with_the_configs_own_descriptions() -> None:
    schema = Overrides.model_json_schema()
    for dotted in FORM_FIELDS:
        section, name = dotted.split(".")
        field = HlatConfig.model_fields[section].annotation.model_fields[name]  # type: ignore[union-attr]
        description = schema["properties"][dotted]["description"]
        assert description.startswith(f"{field.description} Empty: the preset's value (tiny ")
        # An empty field is absent: the form shows the type alone, not a null branch ('Property is type "None"').
        assert "anyOf" not in schema["properties"][dotted] and "default" not in schema["properties"][dotted]
    assert schema["additionalProperties"] is True
    assert (
        "tiny 600 · hlat-7b 429,000 · hlat-70b 429,000 · pythia-6.9b 143,000 · neox-20b 150,000"
        in (schema["properties"]["training.max_steps"]["description"])
    )


def test_overrides_keep_set_fields_and_extra_paths_and_drop_empty_ones() -> None:
    model = Overrides.model_validate(
        {"training.max_steps": 50, "evaluation.tasks": ["hlat_cloze"], "job.max_restarts": 3, "job.budget_usd": None}
    )
    assert model.as_dict() == {"training.max_steps": 50, "evaluation.tasks": ["hlat_cloze"], "job.max_restarts": 3}
    # As a flow run stores it (the fields that are set, extra paths as given) and back.
    stored = model.model_dump(mode="json")
    assert "training.lr" not in stored and overrides_dict(stored) == model.as_dict()
    assert Overrides().model_dump(mode="json") == {}  # the form's default: nothing changed
    assert overrides_dict(None) == {} and overrides_dict({"job.kms_key_id": None}) == {"job.kms_key_id": None}


def test_a_form_field_is_checked_like_the_config_field() -> None:
    with pytest.raises(ValidationError, match=r"training\.max_steps"):
        Overrides.model_validate({"training.max_steps": 0})


@pytest.mark.parametrize("name", [*STAGE_NAMES, "pretrain"])
def test_every_flow_takes_the_same_typed_parameters(name: str) -> None:
    fn = hlat if name == "pretrain" else stage_flow_of(stage(name))
    schema = parameter_schema(fn.fn).model_dump()
    props = schema["properties"]
    assert list(props)[:4] == ["preset", "run_id", "storage", "overrides"]
    assert props["preset"]["enum"] == list(PRESETS) and props["preset"]["default"] == "tiny"
    assert all(props[p].get("description") for p in props)
    # Optional parameters show as their type alone in the form, not as a str/None switch.
    assert all("anyOf" not in props[p] for p in props), props
    assert props["run_id"]["type"] == props["storage"]["type"] == "string"
    assert props["overrides"]["default"] == {}
    assert schema["definitions"]["Overrides"]["properties"].keys() == set(FORM_FIELDS)
    assert list(inspect.signature(fn.fn).parameters)[4:] == (["step"] if name == "evaluate" else [])


def test_an_unfilled_deployment_placeholder_is_named_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match=r"storage='\{\{ \$HLAT_S3_ROOT \}\}'.*hlat deploy"):
        resolve("hlat-7b", None, None, "{{ $HLAT_S3_ROOT }}")
    with pytest.raises(ConfigError, match=r"overrides\['job.role_arn'\]"):
        resolve("tiny", {"job.role_arn": "{{ prefect.blocks.secret.role }}"}, None, None)


@pytest.mark.parametrize(
    "argv", [["pretrain"], *(["run", s] for s in STAGE_NAMES), ["run", "evaluate", "--step", "3", "--set", "a.b=1"]]
)
def test_what_the_cli_passes_is_valid_for_the_flow(argv: list[str]) -> None:
    """With or without --set: the flow's own parameter validation accepts the CLI's call (as Prefect runs it)."""
    args = build_parser().parse_args(argv)
    fn, params = flow_call(args, _overrides(args.overrides))
    validated = fn.validate_parameters(params)
    assert overrides_dict(validated["overrides"]) == dict(parse_override(o) for o in args.overrides)
