# The image of production flow runs (an ECS or Kubernetes work pool `hlat`): this project's dependencies, CPU
# torch, git for the deployments' git-clone pull step. The flow runs only orchestrate: data preparation and
# tokenizer training run here (size the task: 4 vCPU / 16 GiB for the AWS presets' tokenizer sample), while
# training, burn-in, precompilation and evaluation run as SageMaker jobs in their own images.
#
#   docker build -f deployments/worker.Dockerfile -t <acct>.dkr.ecr.<region>.amazonaws.com/hlat-worker:<tag> .
#   docker push <acct>.dkr.ecr.<region>.amazonaws.com/hlat-worker:<tag>
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends git \
 && rm -rf /var/lib/apt/lists/*

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
# then the project with the pins that work together.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir -c constraints.txt . \
 && python -c "import hlat.flows.pretrain, prefect_aws"

ENV HLAT_PROJECT_DIR=/opt/hlat PYTHONUNBUFFERED=1
