#!/usr/bin/env bash
# Build the flow runs' image (deployments/worker.Dockerfile) from this checkout and push it to the ECR repository of
# the account stack (deployments/account.yaml), tagged with the checkout's commit (-dirty when tracked files
# changed), the tag `hlat deploy --stack` then sets in the ECS work pool. Needs Docker with buildx (the image is
# built for Fargate's linux/amd64) and AWS credentials that may push to the repository.
#
#   deployments/push-worker-image.sh --stack hlat [--region us-west-2] [--tag T] [--dry-run]
#
# The work is hlat.deploy.push_worker_image (Python, boto3): the stack's outputs, the ECR login (its password on
# docker's stdin, never on a command line), docker build and push.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
cd "$root"
exec "$python" -c 'import sys; from hlat.deploy import push_image_main; sys.exit(push_image_main(sys.argv[1:]))' "$@"
