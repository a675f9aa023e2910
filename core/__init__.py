"""The ground both the control plane (`infra/`) and the job programs (`training/`) stand on: the config schema and
presets, the run layout, the job contract and storage. Imports neither torch nor Prefect."""
