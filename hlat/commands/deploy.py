"""`hlat deploy` and `hlat worker`: register the deployments, serve a work pool (the work is in hlat/deploy.py)."""

from __future__ import annotations

import argparse

from hlat import deploy as tooling


def deploy(args: argparse.Namespace) -> int:
    return tooling.deploy(
        args.names,
        pool_type=args.pool_type,
        stack=args.stack,
        region=args.region,
        alerts_block=args.alerts_block,
        allow_open_server=args.allow_open_server,
    )


def worker(args: argparse.Namespace) -> int:
    tooling.worker(args.pool, pool_type=args.pool_type, limit=args.limit, name=args.name, stack=args.stack,
                   region=args.region, allow_open_server=args.allow_open_server)  # fmt: skip
