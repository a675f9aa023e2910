# The image of production flow runs (an ECS or Kubernetes work pool `hlat`): this project's code and dependencies,
# CPU torch. The AWS deployments run the code baked in here (their pull step is a `set_working_directory` to
# /opt/hlat), so the image is the code: build it from the checkout you deploy. The flow runs only orchestrate: data
# preparation and tokenizer training run here (size the task: 4 vCPU / 16 GiB for the AWS presets' tokenizer
# sample), while training, burn-in, precompilation and evaluation run as SageMaker jobs in their own images.
#
#   deployments/push-worker-image.sh --stack hlat     # build for linux/amd64, tag with the commit, push to the
#                                                     # stack's ECR repository (add --dry-run to see the commands)
# The base by digest: push-worker-image.sh resolves python:3.11-slim to the digest it pulled (or takes
# HLAT_WORKER_BASE=python@sha256:... as given) and builds on exactly that image.
ARG PYTHON_BASE=python:3.11-slim
FROM ${PYTHON_BASE}

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
# SageMaker driver uploads deployments/*-requirements.txt from beside the package (infra/backends/sagemaker_source.py:
# PROJECT_ROOT), which a wheel install into site-packages would not have.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir -c constraints.txt -e . \
 && python -c "import hlat.flows.pretrain, prefect_aws, hlat.infra.backends.sagemaker_source as s; \
assert str(s.PROJECT_ROOT) == '/opt/hlat', s.PROJECT_ROOT"

# The commit the code was built from (deployments/push-worker-image.sh passes it), for `docker inspect` and logs.
ARG HLAT_CODE_VERSION=unknown
ENV HLAT_PROJECT_DIR=/opt/hlat HLAT_CODE_VERSION=$HLAT_CODE_VERSION PYTHONUNBUFFERED=1

# Flow runs run as an unprivileged user (the code is root's and read-only to it; ~ holds Prefect's and hlat's caches).
RUN useradd --create-home --uid 10001 --user-group hlat
USER 10001:10001
ENV HOME=/home/hlat
