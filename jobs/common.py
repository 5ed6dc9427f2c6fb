"""What every job script shares: its argument parser's common options and the session.

Kept here rather than in each script so that they all find the cluster the same way.
"""
from __future__ import annotations

import argparse

import uniun_ray


def job_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--address", help="Ray address (default: RAY_ADDRESS, the head `uniun-ray up` "
                                          "started, the last `ray start`; else a private local Ray)")
    return parser


def session(args: argparse.Namespace, models: dict[str, str] | None = None) -> None:
    """Join (or start) Ray and get or create the scheduler, model and embedder actors; ``models``
    (id -> folder) are served beside the embedded ones where this script creates the scheduler
    (a running one serves what its operator configured: `--model ID=PATH`, UNIUN_MODELS)."""
    uniun_ray.connect(args.address)
    uniun_ray.start(models=models)
