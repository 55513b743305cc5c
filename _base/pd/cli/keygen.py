"""`pd keygen DIR`: make the deployment's CURVE keypair, for `--curve-keys DIR`.

Writes DIR/pd.key (the public key) and DIR/pd.key_secret (the keypair), both readable only by
their owner, in a directory made 0700. Copy DIR to every host of the deployment (keeping the
modes) and start every process (`pd launch`, `pd router`, `pd prefill`, `pd decode`) with
`--curve-keys DIR` or PD_CURVE_KEYS=DIR: their ZMQ sockets then admit only each other. Any
further `*.key` public key dropped into DIR is admitted as a client too. What the keys do is
`pd/wire/security.py`'s business.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="directory for the keys (made if missing)")
    p.add_argument("--force", action="store_true",
                   help="replace keys already in DIR (every process must then get the new ones)")


def main(args: argparse.Namespace) -> int:
    from pd.wire.security import KeysError, generate

    try:
        keys = generate(args.dir, force=args.force)
    except (KeysError, OSError) as e:
        print(f"pd keygen: {e}", file=sys.stderr)
        return 1
    print(f"wrote the CURVE keypair to {keys.directory} (public key {keys.public_key.decode()})\n"
          f"copy {keys.directory} to every host and pass --curve-keys {keys.directory} "
          f"to every pd process")
    return 0
