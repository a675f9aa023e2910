# The image of production flow runs (an ECS or Kubernetes work pool `hlat`): this project's code and dependencies,
# CPU torch. The AWS deployments run the code baked in here (their pull step is a `set_working_directory` to
# /opt/hlat), so the image is the code: build it from the checkout you deploy. The flow runs only orchestrate: data
# preparation and tokenizer training run here (size the task: 4 vCPU / 16 GiB for the AWS presets' tokenizer
# sample), while training, burn-in, precompilation and evaluation run as SageMaker jobs in their own images.
#
#   deployments/push-worker-image.sh --stack hlat     # build for linux/amd64, tag with the commit, push to the
#                                                     # stack's ECR repository (add --dry-run to see the commands)
FROM python:3.11-slim

WORKDIR /opt/hlat
COPY pyproject.toml constraints.txt README.md ./
COPY hlat/ hlat/
COPY core/ core/
COPY flows/ flows/
COPY tasks/ tasks/
COPY training/ training/
COPY infra/ infra/
COPY deployments/ deployments/

# CPU torch first, from PyTorch's CPU index (PyPI's build of the same version brings GBs of CUDA libraries),
# then the project with the pins that work together. Editable, so that `hlat` imports from /opt/hlat itself: the
# SageMaker driver uploads deployments/*-requirements.txt from beside the package (infra/sagemaker_jobs.py:
# PROJECT_ROOT), which a wheel install into site-packages would not have.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir -c constraints.txt -e . \
 && python -c "import hlat.flows.pretrain, prefect_aws, hlat.infra.sagemaker_jobs as s; \
assert str(s.PROJECT_ROOT) == '/opt/hlat', s.PROJECT_ROOT"

# The commit the code was built from (deployments/push-worker-image.sh passes it), for `docker inspect` and logs.
ARG HLAT_CODE_VERSION=unknown
ENV HLAT_PROJECT_DIR=/opt/hlat HLAT_CODE_VERSION=$HLAT_CODE_VERSION PYTHONUNBUFFERED=1
