"""The entry script of every SageMaker job, uploaded as `hlat_job.py` (`infra.backends.sagemaker_source.stage_source`).

SageMaker's drivers run a script by path. This one runs the module `HLAT_JOB_MODULE` names, as `python -m` would. The
script's folder, holding the `hlat` package, comes first on sys.path, so no path set-up is needed. Standard library
only: the Neuron images run Python 3.10.
"""

import os
import runpy

if __name__ == "__main__":
    runpy.run_module(os.environ["HLAT_JOB_MODULE"], run_name="__main__", alter_sys=True)
