"""The entry script of every SageMaker job, uploaded as `hlat_job.py` at the top of the job's source code
(`infra.sagemaker_jobs.stage_source`).

SageMaker's drivers run a script by path (`torchrun ... hlat_job.py --config <uri>` for the Torchrun driver). This one
runs the job's program, the module `HLAT_JOB_MODULE` names (`hlat.training.train`, ...), as `python -m` would, with
the job's arguments. Python puts the script's folder, the uploaded source, first on sys.path, and the `hlat` package
lies there, so the program imports the uploaded code with no path set-up of its own. Standard library only (the
Neuron images' Python is 3.10).
"""

import os
import runpy

if __name__ == "__main__":
    runpy.run_module(os.environ["HLAT_JOB_MODULE"], run_name="__main__", alter_sys=True)
