"""CURVE security for the ZMQ sockets of a deployment: one keypair, made by `pd keygen DIR`.

A process given `--curve-keys DIR` (env PD_CURVE_KEYS) calls `configure(DIR)` once at start.
From then on `secure_server(sock)`, called on a socket before it binds, makes it a CURVE server
whose clients a ZAP authenticator (one thread per ZMQ context, started with the first server
socket) admits only if their public key is one of DIR's `*.key` files or the deployment's own;
`secure_client(sock)`, called before a socket connects, makes it a CURVE client that proves the
deployment's secret key and accepts only a server holding it. So a peer without the secret key
cannot reach a node or a router, nor pose as one; traffic is encrypted. Without `configure`,
both functions do nothing and sockets stay plain (the NULL mechanism).

A node that binds an address other machines can reach refuses to start without keys unless it
is told `--insecure` (`check_bind`): plain sockets on a network let anyone who reaches a port
submit work, push tokens into another's stream or take a peer's place.

Leaves to others: calling these on every socket they create (pd/service/node.py, pd/service/client.py,
router/zmq_backend.py, shm_ipc transports, receiver and doorbell), and copying DIR to every host.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import logging
import os
import socket
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger(__name__)

ENV = "PD_CURVE_KEYS"
PUBLIC_FILE = "pd.key"  # the public key: what servers admit (every *.key file in DIR is admitted)
SECRET_FILE = "pd.key_secret"  # the keypair; readable only by its owner
ZAP_DOMAIN = "pd"


class KeysError(ValueError):
    """A key directory that cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class CurveKeys:
    directory: str
    public_key: bytes  # Z85, 40 bytes
    secret_key: bytes = field(repr=False)  # Z85, 40 bytes
    admitted: frozenset[bytes] = frozenset()  # client public keys (Z85) servers let in

    def __post_init__(self) -> None:
        for name in ("public_key", "secret_key"):
            value = getattr(self, name)
            try:
                ok = len(value) == 40 and len(z85.decode(value)) == 32
            except (KeyError, ValueError):
                ok = False
            if not ok:
                raise KeysError(f"{name} in {self.directory} is not a 40-character Z85 CURVE key")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "CurveKeys":
        d = Path(directory)
        secret = d / SECRET_FILE
        if not d.is_dir():
            raise KeysError(f"{d} is not a directory (make one with `pd keygen {d}`)")
        if not secret.is_file():
            raise KeysError(f"{secret} is missing (make the keys with `pd keygen {d}`)")
        mode = stat.S_IMODE(secret.stat().st_mode)
        if mode & 0o077:
            raise KeysError(f"{secret} is readable by others (mode {mode:04o}); "
                            f"`chmod 600 {secret}`")
        try:
            public, secret_key = zmq.auth.load_certificate(secret)
            admitted = set(zmq.auth.load_certificates(d))
        except (OSError, ValueError) as e:
            raise KeysError(f"cannot read the keys in {d}: {e}") from None
        if not secret_key:
            raise KeysError(f"{secret} holds no secret-key")
        try:
            return cls(str(d.resolve()), public, secret_key, frozenset(admitted | {public}))
        except ValueError as e:
            raise KeysError(str(e)) from None


def generate(directory: str | os.PathLike, force: bool = False) -> CurveKeys:
    """Write a fresh deployment keypair into `directory` (made 0700 if new), files 0600."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (d / SECRET_FILE).exists() and not force:
        raise KeysError(f"{d / SECRET_FILE} exists; pass --force to replace the deployment's keys")
    public, secret = zmq.curve_keypair()
    body = f"curve\n    public-key = \"{public.decode()}\"\n"
    _write_private(d / PUBLIC_FILE, "#   pd CURVE public key\n" + body)
    _write_private(d / SECRET_FILE, "#   pd CURVE secret key: DO NOT SHARE outside the deployment\n"
                   + body + f"    secret-key = \"{secret.decode()}\"\n")
    return CurveKeys.load(d)


def _write_private(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# -- the process's configuration -------------------------------------------------------------
_keys: CurveKeys | None = None
_authenticators: dict[int, "zmq.auth.thread.ThreadAuthenticator"] = {}  # context -> its ZAP thread
_lock = threading.Lock()


def add_arguments(group) -> None:
    group.add_argument("--curve-keys", metavar="DIR", default=os.environ.get(ENV) or None,
                       help="CURVE keys made by `pd keygen DIR` (copied to every host): every "
                            "ZMQ socket is then encrypted and admits only peers holding them; "
                            "pd launch passes DIR to its nodes "
                            f"(default: ${ENV}; none: plain sockets)")


def configure(directory: str | os.PathLike | None) -> CurveKeys | None:
    """Load DIR's keys for every socket this process creates from now on (None: plain sockets)."""
    global _keys
    _keys = CurveKeys.load(directory) if directory else None
    if _keys is not None:
        log.info("CURVE on: keys from %s, %d client key(s) admitted",
                 _keys.directory, len(_keys.admitted))
    return _keys


def configure_from_args(args: argparse.Namespace) -> CurveKeys | None:
    """`configure(args.curve_keys)` for a command's main; a bad DIR exits with its reason."""
    try:
        return configure(args.curve_keys)
    except KeysError as e:
        raise SystemExit(f"pd: --curve-keys: {e}") from None


def active() -> CurveKeys | None:
    return _keys


def is_loopback(host: str) -> bool:
    """Whether a socket bound to `host` is reachable from this machine alone: a loopback
    address, or a name whose every address is one (0.0.0.0, ::, and names that do not
    resolve are not)."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_bind(host: str, insecure: bool) -> None:
    """Refuse (SystemExit, one line) to serve plain sockets on `host` when other machines can
    reach it, unless `insecure`; call after `configure`. With `insecure` it warns instead."""
    if _keys is not None or is_loopback(host):
        return
    if insecure:
        log.warning("plain ZMQ sockets on %s (--insecure): anyone who reaches its ports can "
                    "submit work and push tokens or KV into this node", host)
        return
    raise SystemExit(
        f"pd: --host {host} is reachable from other machines but no --curve-keys were given: "
        f"anyone who reaches its ports could submit work and push tokens or KV into it. Give the "
        f"deployment's keys (pd keygen DIR, then --curve-keys DIR or {ENV}=DIR), or --insecure "
        f"to serve plain sockets anyway")


def secure_server(sock: zmq.Socket) -> None:
    """Make `sock` (not yet bound) a CURVE server behind the ZAP authenticator, if configured."""
    keys = _keys
    if keys is None:
        return
    _may_start_authenticator(sock.context)
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def secure_client(sock: zmq.Socket) -> None:
    """Make `sock` (not yet connected) a CURVE client of the deployment's servers, if configured."""
    keys = _keys
    if keys is None:
        return
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_serverkey = keys.public_key


class _Admit:
    """The authenticator's credentials provider: reads the keys in force at each handshake."""

    def callback(self, domain: str, key: bytes) -> bool:
        keys = _keys
        return keys is not None and key in keys.admitted


def _may_start_authenticator(ctx: zmq.Context) -> None:
    from zmq.auth.thread import ThreadAuthenticator

    with _lock:
        if ctx.underlying in _authenticators:
            return
        # NOTE: ZAP handlers are per libzmq context, and libzmq lets every CURVE client in when
        # none is bound, so this must run before the first server socket binds.
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("pd.wire.security.zap"))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_Admit())
        if not _authenticators:
            atexit.register(stop)
        _authenticators[ctx.underlying] = auth


def stop() -> None:
    """Stop every ZAP thread (at exit; tests that configure call it when done)."""
    with _lock:
        for auth in _authenticators.values():
            auth.stop()
        _authenticators.clear()
