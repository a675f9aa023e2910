"""Launch the training entrypoint on this machine: one process, or torchrun with several.

The job backends of the SageMaker issue generalise this; here a training job is a child process group whose
exit code says what happened (0 done or stopped cleanly, EXIT_NAN a non-finite loss, negative: killed).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from training.exit_codes import EXIT_NAN

log = logging.getLogger("hlat.train")


@dataclass(frozen=True)
class TrainingExit:
    returncode: int

    @property
    def resumable(self) -> bool:
        """Worth relaunching from the last checkpoint: killed by a signal, or exited on a NaN/inf loss."""
        return self.returncode < 0 or self.returncode in (EXIT_NAN, 128 + signal.SIGKILL, 128 + signal.SIGTERM)


class TrainingFailed(RuntimeError):
    def __init__(self, exit: TrainingExit) -> None:
        self.exit = exit
        how = f"killed by signal {-exit.returncode}" if exit.returncode < 0 else f"exit code {exit.returncode}"
        super().__init__(f"training job failed ({how}); {'resumable' if exit.resumable else 'not resumable'}")


def training_command(config_uri: str, processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "training.train", "--config", config_uri]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "training.train", "--config", config_uri,
    ]  # fmt: skip


def run_training(config_uri: str, processes: int, env: dict[str, str] | None = None) -> TrainingExit:
    """Run a training job to its end, streaming its output into our log; raise TrainingFailed on failure."""
    cmd = training_command(config_uri, processes)
    log.info("launching: %s", " ".join(cmd))
    child_env = {
        **os.environ,
        **(env or {}),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes))),
    }
    proc = subprocess.Popen(
        cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.info("%s", line.rstrip())
        code = proc.wait()
    except BaseException:
        # The flow was cancelled or crashed: the job must not outlive it.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    result = TrainingExit(code)
    if code != 0:
        raise TrainingFailed(result)
    return result
