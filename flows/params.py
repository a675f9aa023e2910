"""Flow parameters, typed so that the Prefect UI renders them as forms.

Every flow takes the same four: `preset` (a drop-down of the presets), `run_id`, `storage` and `overrides`.
`overrides` is a Pydantic model: the config fields people change most often from the UI are typed form fields
(named by their dotted config path, described by the config's own docstrings, empty = the preset's value), and
any other dotted path is accepted as an extra key, exactly as `hlat ... --set PATH=VALUE` takes it:

    prefect deployment run hlat/pretrain-tiny --param run_id=r1 --param overrides='{"training.max_steps": 50}'

The parameters stay flat (not one nested model) so that `--param run_id=...` changes one parameter and keeps the
deployment's others.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, model_serializer

from hlat.core.config import ConfigError, HlatConfig, MixtureStep, SourceConfig
from hlat.core.presets import load_config

PresetName = Literal["tiny", "hlat-7b", "hlat-70b", "pythia-6.9b", "neox-20b"]
"""The presets of core/presets.py (a test keeps the two lists equal)."""


def optional_in_form(schema: dict[str, Any]) -> None:
    """JSON-schema hook of an optional field: show it as its type alone, empty by default.

    Pydantic writes `X | None = None` as `anyOf: [X, null], default: null`, which Prefect's form draws as a type
    switch stuck on "None" ('Property is type "None"'). A field left empty is absent from the parameters, and
    absent means None here, so the null branch and the null default add nothing to the form."""
    branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    if len(branches) == 1:
        del schema["anyOf"]
        schema.update(branches[0])
    if schema.get("default", 0) is None:
        del schema["default"]


# Optional parameters as the form shows them: their type alone (see optional_in_form). Prefect builds the flows'
# parameter schema from the annotations and keeps only the description of a Field default.
OptionalText = Annotated[str | None, WithJsonSchema({"type": "string"})]
OptionalStep = Annotated[int | None, WithJsonSchema({"type": "integer", "minimum": 0})]

# Defaults of the flows' parameters, with the descriptions the UI shows under each field.
PRESET: Any = Field("tiny", description="Named preset the run starts from (`hlat presets` lists them).")
RUN_ID: Any = Field(
    None,
    description="Run identifier: the run's outputs live under `STORAGE/RUN_ID/`. Empty derives `PRESET-CONFIGHASH` "
    "from the config, so equal configs share a run and re-runs reuse its cached stages.",
)
STORAGE: Any = Field(
    None,
    description="Folder or s3://bucket/prefix that holds the runs. Empty: the preset's (./runs).",
)
STEP: Any = Field(
    None,
    ge=0,
    description="Checkpoint step to evaluate. Empty: the newest committed checkpoint.",
)
AVERAGED: Any = Field(
    False,
    description="Evaluate `hlat average`'s checkpoint (<run>/averaged/step-N, the mean of the last K checkpoints) "
    "instead of the training's.",
)

FORM_FIELDS = (
    "data.sources",
    "data.schedule",
    "data.max_documents",
    "training.max_steps",
    "training.lr",
    "training.global_batch_size",
    "training.checkpoint_every",
    "job.instance_count",
    "job.budget_usd",
    "evaluation.tasks",
    "evaluation.limit",
)
"""Config fields with their own typed field in the overrides form. data.sources is the same list of sources a
--config file gives (each entry a form of SourceConfig's fields: reader settings, weight, max_epochs, tokens)."""


def preset_values(dotted: str) -> str:
    """'tiny 600 · hlat-7b 429,000 · ...': a config field's value in each preset, for the form's descriptions."""
    from hlat.core.presets import PRESETS

    def shown(value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        if isinstance(value, list):
            return ", ".join(map(item, value)) or "none"
        return str(value)

    def item(value: Any) -> str:
        """A list's entry: a source by its name, a schedule entry by its step."""
        if isinstance(value, SourceConfig):
            return value.resolved_name
        if isinstance(value, MixtureStep):
            return f"from step {value.step:,}"
        return str(value)

    section, name = dotted.split(".")
    return " · ".join(f"{p} {shown(getattr(getattr(load_config(p), section), name))}" for p in PRESETS)


def entries_in_form(model: type[BaseModel]) -> dict[str, Any]:
    """JSON schema of a list of `model` entries (data.sources, data.schedule) as the form draws it: each entry's
    fields inline (no $ref), an entry's field whose default is None shown as its type alone, as optional_in_form
    does for the form's own fields (max_epochs keeps its null branch: None there means no limit, not its default)."""
    entry = model.model_json_schema()
    for prop in entry["properties"].values():
        if prop.get("default", 0) is None:
            optional_in_form(prop)
    return {"type": "array", "items": entry}


def _config_field(dotted: str) -> tuple[Any, Any]:
    """(annotation, FieldInfo) of a form field: the config field's type made optional, its docstring and each
    preset's value, its path."""
    section, name = dotted.split(".")
    info = HlatConfig.model_fields[section].annotation.model_fields[name]  # type: ignore[union-attr]
    annotation = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    (entry,) = get_args(info.annotation) if get_origin(info.annotation) is list else (None,)
    if isinstance(entry, type) and issubclass(entry, BaseModel):  # a list of config entries: drawn inline
        annotation = Annotated[annotation, WithJsonSchema(entries_in_form(entry))]
    description = f"{info.description} Empty: the preset's value ({preset_values(dotted)})."
    field = Field(None, alias=dotted, title=dotted, description=description, json_schema_extra=optional_in_form)
    return annotation | None, field


class _OverridesBase(BaseModel):
    model_config = ConfigDict(
        extra="allow", frozen=True, validate_by_alias=True, validate_by_name=True, serialize_by_alias=True
    )

    @model_serializer(mode="wrap")
    def _without_empty_fields(self, handler: Any) -> dict[str, Any]:
        """Form fields left empty are not written (the form's default is then `{}`, not nine nulls); an extra path
        set to None is kept: it sets that config field to None."""
        dumped: dict[str, Any] = handler(self)
        return {k: v for k, v in dumped.items() if v is not None or k not in FORM_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        """The dotted-path overrides load_config takes: the form fields that are set, then every extra path (an
        extra path set to None is kept: it sets that config field to None)."""
        return self.model_dump(mode="json", by_alias=True)


if TYPE_CHECKING:
    Overrides = _OverridesBase
else:
    Overrides = create_model(
        "Overrides",
        __base__=_OverridesBase,
        __doc__="Changes to the preset, by dotted config path. Empty fields keep the preset's value; other paths "
        "(e.g. {'job.max_restarts': 10}) are accepted as extra keys, as `hlat --set PATH=VALUE` takes them.",
        **{dotted.replace(".", "__"): _config_field(dotted) for dotted in FORM_FIELDS},
    )


def overrides_dict(value: Any) -> dict[str, Any]:
    """Overrides as a plain dict of dotted paths, from the model, a dict (as stored on a flow run) or None."""
    if value is None:
        return {}
    model = value if isinstance(value, _OverridesBase) else Overrides.model_validate(dict(value))
    return model.as_dict()


OVERRIDES: Any = Field(
    Overrides(), description="Changes to the preset: the form's fields by dotted config path; empty keeps the preset."
)


# The config the CLI built for the flow it runs (handing_over): one config per command, not one per check.
_HANDED: ContextVar[tuple[str, HlatConfig] | None] = ContextVar("hlat_handed_config", default=None)


def _parameters_key(preset: str, changes: dict[str, Any], run_id: str | None, storage: str | None) -> str:
    return json.dumps([preset, changes, run_id, storage], sort_keys=True, default=str)


def build_config(preset: str, changes: dict[str, Any], run_id: str | None, storage: str | None) -> HlatConfig:
    """The config of a command or flow run from its preset, its overrides (a dict of dotted paths, a deployment's
    already merged under the run's: `merged_overrides`), run id and storage: the one place a config is built from
    them. A flow started by the CLI gets the config the CLI built from the same parameters (`handing_over`)."""
    given = {"run_id": run_id, "storage": storage, **{f"overrides[{k!r}]": v for k, v in changes.items()}}
    unfilled = [f"{name}={value!r}" for name, value in given.items() if isinstance(value, str) and "{{" in value]
    if unfilled:
        raise ConfigError(
            f"{', '.join(unfilled)}: a deployment placeholder was never filled in; set the variable it names before "
            "`hlat deploy` (deployments/prefect.yaml lists them), or give the value as a parameter of this run"
        )
    handed = _HANDED.get()
    if handed is not None and handed[0] == _parameters_key(preset, changes, run_id, storage):
        return handed[1]
    refused = sorted(set(changes) & set(HOST_PATHS))
    if refused:
        raise ConfigError(
            f"{', '.join(refused)}: {HOST_PATHS[refused[0]]}, which a flow run's parameters do not choose (whoever can "
            "start a run would choose what runs on the worker's host); give it on the command line "
            f"(`hlat run ... --set {refused[0]}=...`), or leave it to the default"
        )
    return load_config(preset, changes, run_id=run_id, storage=storage)


HOST_PATHS = {"job.python": "an interpreter the local backend runs on the worker's host"}
"""Config paths that name something to run on the machine of the flow run: taken from the CLI, which its user runs
on their own machine, and refused from a flow run's parameters (the Prefect API's)."""


@contextmanager
def handing_over(
    config: HlatConfig, preset: str, overrides: Any, run_id: str | None, storage: str | None
) -> Iterator[None]:
    """While the CLI runs a flow: `config`, which it built from these parameters, is the flow's (build_config)."""
    token = _HANDED.set((_parameters_key(preset, overrides_dict(overrides), run_id, storage), config))
    try:
        yield
    finally:
        _HANDED.reset(token)
