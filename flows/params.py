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

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from training.config import HlatConfig

PresetName = Literal["tiny", "hlat-7b", "hlat-70b", "pythia-6.9b", "neox-20b"]
"""The presets of training/presets.py (a test keeps the two lists equal)."""

# Defaults of the flows' parameters, with the descriptions the UI shows under each field.
PRESET: Any = Field("tiny", description="Named preset the run starts from (`hlat presets` lists them).")
RUN_ID: Any = Field(
    None,
    description="Run identifier: the run's outputs live under `STORAGE/RUN_ID/`. Empty derives `PRESET-CONFIGHASH` "
    "from the config, so equal configs share a run and re-runs reuse its cached stages.",
)
STORAGE: Any = Field(
    None, description="Folder or s3://bucket/prefix that holds the runs. Empty: the preset's (./runs)."
)
STEP: Any = Field(None, ge=0, description="Checkpoint step to evaluate. Empty: the newest committed checkpoint.")

FORM_FIELDS = (
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
"""Config fields with their own typed field in the overrides form."""


def _config_field(dotted: str) -> tuple[Any, Any]:
    """(annotation, FieldInfo) of a form field: the config field's type made optional, its docstring, its path."""
    section, name = dotted.split(".")
    info = HlatConfig.model_fields[section].annotation.model_fields[name]  # type: ignore[union-attr]
    annotation = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return annotation | None, Field(None, alias=dotted, title=dotted, description=info.description)


class _OverridesBase(BaseModel):
    model_config = ConfigDict(
        extra="allow", frozen=True, validate_by_alias=True, validate_by_name=True, serialize_by_alias=True
    )

    def as_dict(self) -> dict[str, Any]:
        """The dotted-path overrides load_config takes: the form fields that are set, then every extra path (an
        extra path set to None is kept: it sets that config field to None)."""
        dumped = self.model_dump(mode="json", by_alias=True)
        return {k: v for k, v in dumped.items() if v is not None or k not in FORM_FIELDS}


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
