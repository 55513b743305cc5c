"""CURVE keys and sockets (pd/wire/security.py) on loopback: `pd keygen` files and modes, key
loading refusals, and who a secured server lets in (the deployment, a key dropped into DIR)
and who it does not (plain sockets, other keypairs); without keys, sockets stay plain; every
socket the packages create goes through it. Every command binds 127.0.0.1 unless told
otherwise."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import zmq

from pd.wire import security
from pd.cli.main import build_parser
from pd.cli.main import main as pd_main

WAIT_MS = 1000


@pytest.fixture
def keys_dir(tmp_path):
    return security.generate(tmp_path / "keys").directory


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    security.configure(None)
    security.stop()
    c.destroy(linger=0)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keygen_writes_owner_only_files(tmp_path, capsys):
    d = tmp_path / "deploy" / "keys"
    assert pd_main(["keygen", str(d)]) == 0
    assert mode(d) == 0o700
    assert mode(d / security.PUBLIC_FILE) == 0o600 and mode(d / security.SECRET_FILE) == 0o600
    keys = security.CurveKeys.load(d)
    assert keys.admitted == {keys.public_key}
    assert keys.secret_key.decode() not in repr(keys)
    assert f"--curve-keys {keys.directory}" in capsys.readouterr().out
    assert pd_main(["keygen", str(d)]) == 1  # never overwrites by accident
    assert "--force" in capsys.readouterr().err
    assert security.CurveKeys.load(d) == keys
    assert pd_main(["keygen", "--force", str(d)]) == 0
    assert security.CurveKeys.load(d).public_key != keys.public_key


def test_load_refuses_bad_directories(tmp_path, keys_dir):
    with pytest.raises(security.KeysError, match="pd keygen"):
        security.CurveKeys.load(tmp_path / "nowhere")
    with pytest.raises(security.KeysError, match="missing"):
        security.CurveKeys.load(tmp_path)
    secret = os.path.join(keys_dir, security.SECRET_FILE)
    os.chmod(secret, 0o640)
    with pytest.raises(security.KeysError, match="chmod 600"):
        security.CurveKeys.load(keys_dir)
    os.chmod(secret, 0o600)
    with open(secret, "w") as f:
        f.write('curve\n    public-key = "short"\n    secret-key = "short"\n')
    with pytest.raises(security.KeysError, match="Z85"):
        security.CurveKeys.load(keys_dir)
    args = build_parser().parse_args(["prefill", "--curve-keys", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="--curve-keys"):
        security.configure_from_args(args)


def test_flag_defaults_to_env(monkeypatch, keys_dir):
    assert build_parser().parse_args(["decode"]).curve_keys is None
    monkeypatch.setenv(security.ENV, keys_dir)
    for command in ("prefill", "decode", "router", "launch"):
        assert build_parser().parse_args([command]).curve_keys == keys_dir


@pytest.mark.parametrize("command", ["prefill", "decode", "router", "launch"])
def test_every_command_binds_loopback_by_default(command):
    assert build_parser().parse_args([command]).host == "127.0.0.1"


def serve(ctx) -> tuple[zmq.Socket, str]:
    srv = ctx.socket(zmq.ROUTER)
    srv.linger = 0
    security.secure_server(srv)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    return srv, f"tcp://127.0.0.1:{port}"


def knock(ctx, addr: str, keys: tuple[bytes, bytes] | None, server_key: bytes | None = None,
          secured: bool = False) -> zmq.Socket:
    """A DEALER that connects to `addr` and sends b"hello": plain, with `keys`, or (secured)
    through secure_client. Keep it until the answer is in: a closed socket drops its message."""
    c = ctx.socket(zmq.DEALER)
    c.linger = 0
    if secured:
        security.secure_client(c)
    elif keys is not None:
        c.curve_publickey, c.curve_secretkey = keys
        c.curve_serverkey = server_key
    c.connect(addr)
    c.send(b"hello")
    return c


def test_without_keys_sockets_stay_plain(ctx):
    srv, addr = serve(ctx)
    assert srv.get(zmq.MECHANISM) == zmq.NULL
    c = knock(ctx, addr, None)
    assert srv.poll(WAIT_MS) and srv.recv_multipart()[1] == b"hello"
    c.close()


def test_curve_admits_the_deployment_only(ctx, keys_dir):
    keys = security.configure(keys_dir)
    srv, addr = serve(ctx)
    assert srv.get(zmq.MECHANISM) == zmq.CURVE
    for who, stranger in (("plain", None), ("other keypair", zmq.curve_keypair())):
        c = knock(ctx, addr, stranger, keys.public_key)
        assert not srv.poll(WAIT_MS), f"a stranger ({who}) got in"
        c.close()
    c = knock(ctx, addr, None, secured=True)
    assert srv.poll(WAIT_MS)
    who, data = srv.recv_multipart()
    assert data == b"hello"
    srv.send_multipart([who, b"welcome"])
    assert c.poll(WAIT_MS) and c.recv() == b"welcome"


def test_client_refuses_a_server_without_the_secret(ctx, keys_dir):
    security.configure(keys_dir)
    impostor = ctx.socket(zmq.ROUTER)
    impostor.linger = 0
    public, secret = zmq.curve_keypair()
    impostor.curve_publickey, impostor.curve_secretkey, impostor.curve_server = public, secret, True
    port = impostor.bind_to_random_port("tcp://127.0.0.1")
    c = knock(ctx, f"tcp://127.0.0.1:{port}", None, secured=True)
    assert not impostor.poll(WAIT_MS)
    c.close()


def test_a_key_dropped_into_the_directory_is_admitted(ctx, keys_dir, tmp_path):
    other = security.generate(tmp_path / "other")
    os.link(os.path.join(other.directory, security.PUBLIC_FILE),
            os.path.join(keys_dir, "guest.key"))
    keys = security.configure(keys_dir)
    assert other.public_key in keys.admitted
    srv, addr = serve(ctx)
    c = knock(ctx, addr, (other.public_key, other.secret_key), keys.public_key)
    assert srv.poll(WAIT_MS) and srv.recv_multipart()[1] == b"hello"
    c.close()


def test_every_socket_the_packages_create_is_secured():
    """Each module that creates ZMQ sockets passes each one through secure_server/secure_client
    (a static count, so that a new socket cannot skip it unnoticed)."""
    root = Path(__file__).resolve().parents[2]
    created = re.compile(r"\.socket\(")
    secured = re.compile(r"secure_(server|client)\(")
    files = [f for pkg in ("pd", "router", "prefill_node", "decode_node", "shm_ipc")
             for f in (root / pkg).rglob("*.py") if f.name != "security.py"]
    counts = {str(f.relative_to(root)): (len(created.findall(t)), len(secured.findall(t)))
              for f in files if "import zmq" in (t := f.read_text())}
    assert sum(n for n, _ in counts.values()) >= 9, counts
    assert all(s >= n for n, s in counts.values()), counts


def test_nodes_on_a_network_address_need_keys_or_insecure(ctx, keys_dir, caplog):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        security.check_bind(host, insecure=False)  # loopback: no keys needed
    for host in ("0.0.0.0", "::", "10.0.0.11"):
        assert not security.is_loopback(host)
        with pytest.raises(SystemExit, match="--curve-keys.*--insecure"):
            security.check_bind(host, insecure=False)
    with caplog.at_level("WARNING", logger="pd.wire.security"):
        security.check_bind("0.0.0.0", insecure=True)
    assert "plain ZMQ sockets on 0.0.0.0" in caplog.text
    security.configure(keys_dir)
    security.check_bind("0.0.0.0", insecure=False)  # keys: every socket is CURVE


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_a_node_on_a_network_address_without_keys_refuses_to_start(command, tmp_path):
    """A real `pd prefill|decode --host 0.0.0.0` without keys exits at once with the reason,
    before it loads a model or binds anything."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != security.ENV}
    out = subprocess.run([sys.executable, "-m", "pd", command, "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode != 0
    assert "reachable from other machines but no --curve-keys" in out.stderr
    assert "Traceback" not in out.stderr
