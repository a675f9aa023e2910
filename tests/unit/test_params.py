"""Flow parameters as the UI renders them: a preset choice, typed override fields, a clear error for a
deployment placeholder that was never filled in."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import get_args

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import ValidationError

from hlat.cli import build_parser, command_overrides
from hlat.commands.flows import flow_call
from hlat.core.config import ConfigError, HlatConfig, SourceConfig, parse_override
from hlat.core.presets import PRESETS, load_config
from hlat.core.stages import stage, stage_names
from hlat.flows.params import FORM_FIELDS, Overrides, PresetName, build_config, overrides_dict
from hlat.flows.pretrain import hlat, stage_flow_of
from hlat.flows.stage import resolve

STAGE_NAMES = stage_names()


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
    with pytest.raises(ValidationError, match=r"data\.sources`?\.0\.wieght"):
        Overrides.model_validate({"data.sources": [{"source": "a.jsonl", "wieght": 0.6}]})


def test_the_form_takes_the_list_of_sources_and_the_schedule_as_the_config_file_does() -> None:
    """data.sources and data.schedule are form fields: arrays whose entries are drawn inline with the config's own
    descriptions, their optional fields as their type alone (no $ref to resolve, no "None" type switch)."""
    fn_schema = parameter_schema(hlat.fn).model_dump()
    assert list(fn_schema["definitions"]) == ["Overrides"]  # entries inline: no SourceConfig to look up
    props = fn_schema["definitions"]["Overrides"]["properties"]
    sources, schedule = props["data.sources"], props["data.schedule"]
    assert sources["type"] == schedule["type"] == "array" and "anyOf" not in sources and "default" not in sources
    entry = sources["items"]
    assert entry["required"] == ["source"] and entry["additionalProperties"] is False
    assert set(entry["properties"]) == set(SourceConfig.model_fields)
    for name, field in SourceConfig.model_fields.items():
        assert entry["properties"][name]["description"] == field.description
    assert entry["properties"]["tokens"] == {
        "description": SourceConfig.model_fields["tokens"].description, "minimum": 1, "title": "Tokens",
        "type": "integer",
    }  # fmt: skip
    # max_epochs keeps its null branch: None there is "no limit", not its default of 4.
    assert [b["type"] for b in entry["properties"]["max_epochs"]["anyOf"]] == ["number", "null"]
    assert schedule["items"]["properties"]["weights"]["additionalProperties"] == {"type": "number"}
    # What the form sends back is what a config file gives: the flow's config has the mixture.
    given = {
        "data.sources": [{"source": "HuggingFaceFW/fineweb", "weight": 0.7}, {"source": "/data/books", "weight": 0.3}],
        "data.schedule": [{"step": 5, "weights": {"fineweb": 1, "books": 1}}],
    }
    validated = hlat.validate_parameters({"preset": "tiny", "overrides": given})
    config = build_config("tiny", overrides_dict(validated["overrides"]), None, None)
    assert [(s.resolved_name, s.weight) for s in config.data.mixture] == [("fineweb", 0.7), ("books", 0.3)]
    assert config.data.weights_at(5) == {"fineweb": 0.5, "books": 0.5}


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
    assert list(inspect.signature(fn.fn).parameters)[4:] == (["step", "averaged"] if name == "evaluate" else [])


def test_an_unfilled_deployment_placeholder_is_named_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match=r"storage='\{\{ \$HLAT_S3_ROOT \}\}'.*hlat deploy"):
        resolve("hlat-7b", None, None, "{{ $HLAT_S3_ROOT }}")
    with pytest.raises(ConfigError, match=r"overrides\['job.role_arn'\]"):
        resolve("tiny", {"job.role_arn": "{{ prefect.blocks.secret.role }}"}, None, None)


@pytest.mark.parametrize(
    "argv",
    [
        ["pretrain"],
        *(["run", s] for s in STAGE_NAMES),
        ["run", "evaluate", "--step", "3", "--set", "a.b=1"],
        ["run", "evaluate", "--averaged"],
    ],
)
def test_what_the_cli_passes_is_valid_for_the_flow(argv: list[str]) -> None:
    """With or without --set: the flow's own parameter validation accepts the CLI's call (as Prefect runs it)."""
    args = build_parser().parse_args(argv)
    fn, params = flow_call(args, command_overrides(args))
    validated = fn.validate_parameters(params)
    assert overrides_dict(validated["overrides"]) == dict(parse_override(o) for o in args.overrides)
    assert validated["preset"] == "tiny"


def test_a_config_file_reaches_the_flow_as_the_one_overrides_dict(tmp_path: Path) -> None:
    """--config then --set: one dict of dotted paths, the file's preset, and the flow builds the CLI's config."""
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "preset: hlat-7b\ndata:\n  sources:\n    - {source: HuggingFaceFW/fineweb, weight: 2, tokens: 15000000000000}\n"
        "    - {source: /data/books, weight: 1, max_epochs: 2}\n  curation: {minhash: true}\n"
        "training: {max_steps: 100}\n"
    )
    args = build_parser().parse_args(["pretrain", "--config", str(mix), "--set", "training.max_steps=50"])
    overrides = command_overrides(args)
    assert list(overrides) == ["data.sources", "data.curation.minhash", "training.max_steps"]
    fn, params = flow_call(args, overrides)
    validated = fn.validate_parameters(params)
    assert validated["preset"] == "hlat-7b"
    flows = build_config(validated["preset"], overrides_dict(validated["overrides"]), None, None)
    assert flows == load_config(args.preset, overrides)  # the same run: same config, same run id
    assert flows.training.max_steps == 50 and flows.data.curation.minhash
    assert [(s.resolved_name, s.tokens, s.max_epochs) for s in flows.data.mixture] == [
        ("fineweb", 15_000_000_000_000, 4.0), ("books", None, 2.0)
    ]  # fmt: skip


def test_a_flow_runs_parameters_cannot_name_an_interpreter_for_the_worker_to_run() -> None:
    """Issue 51: job.python (the local backend's interpreter) comes from the command line only; given as a flow
    run's parameter (from the Prefect API) it is refused, naming the field and the way to set it."""
    from hlat.flows.params import build_config, handing_over

    with pytest.raises(ConfigError, match=r"job.python: an interpreter the local backend runs on the worker's host"):
        build_config("tiny", {"job.python": "/tmp/attacker/python"}, None, None)
    # The CLI's own config, handed to the flow it runs, keeps it.
    from hlat.core.presets import load_config

    mine = load_config("tiny", {"job.python": "/opt/venv/bin/python"})
    with handing_over(mine, "tiny", {"job.python": "/opt/venv/bin/python"}, None, None):
        assert (
            build_config("tiny", {"job.python": "/opt/venv/bin/python"}, None, None).job.python
            == "/opt/venv/bin/python"
        )
