"""`pd serve MODEL`: vLLM's spelling of `pd launch --model MODEL` (router + one prefill node +
one decode node on this host, unless --num-prefill / --num-decode say more); every flag of
`pd launch` applies."""

from __future__ import annotations

import argparse
import sys

from pd.cli import launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                   help="the model directory (as --model; default: the embedded pd-tiny-code)")
    launch.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    if args.model_dir is not None:
        if args.model is not None and args.model != args.model_dir:
            print(f"pd serve: error: MODEL {args.model_dir!r} and --model {args.model!r} differ",
                  file=sys.stderr)
            return 2
        args.model = args.model_dir
    return launch.main(args)
