"""Entrypoint of a training job: `python -m training.train --config <path or s3 uri of config.json>`.

Run under torchrun for several processes. The run's folder is the config's folder: data/ and tokenizer/ are
read from it, metrics.jsonl is written to it, checkpoints go to its checkpoints/ (or, inside a SageMaker
container, to the local checkpoint folder SageMaker syncs with the run's checkpoint prefix).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from infra.storage import Storage
from training.config import validate_config
from training.distributed import close_world, init_world
from training.faults import checkpoint_storage
from training.sagemaker import checkpoint_location, tensorboard_location
from training.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__)
    parser.add_argument("--config", required=True, help="path or s3:// URI of the run's config.json")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="rank" + os.environ.get("RANK", "0") + " %(message)s")

    config_uri = args.config.rstrip("/")
    run = Storage(config_uri.rsplit("/", 1)[0])
    cfg = validate_config(run.read_json(config_uri.rsplit("/", 1)[1]))
    world = init_world(args.device)
    try:
        with tempfile.TemporaryDirectory(prefix="hlat-train-") as tmp:
            tokenizer = os.path.join(tmp, "tokenizer.model")
            run.child("tokenizer").get_file("tokenizer.model", tokenizer)
            trainer = Trainer(
                cfg=cfg,
                run=run,
                checkpoints=checkpoint_storage(checkpoint_location(run)),
                world=world,
                tokenizer_model=tokenizer,
                tensorboard_dir=tensorboard_location(run),
            )
            trainer.resume()
            return trainer.fit()
    finally:
        close_world()


if __name__ == "__main__":
    sys.exit(main())
