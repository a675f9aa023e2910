"""hlat: one import namespace for the whole project.

The project's layers stay top-level folders (docs/layout.md), mapped into this package by pyproject.toml's
package-dir (hlat.core is core/, ...), so that every import reads `hlat.<layer>.<module>` and an installed hlat adds
one name, `hlat`, to site-packages:

    hlat.core       the ground: config schema and presets, run layout, job contract, storage (no torch, no Prefect)
    hlat.training   what runs inside a job: the job programs and their libraries (no Prefect)
    hlat.infra      the control plane: job backends, planner, catalog, AWS (no torch, no Prefect)
    hlat.tasks      Prefect tasks, one retryable unit of work each
    hlat.flows      Prefect flows chaining the tasks
    hlat.cli, hlat.deploy   the `hlat` command and the deployment tooling
    hlat.commands   the `hlat` command's commands, imported when one runs
"""
