"""Security of a running deployment, as real processes on loopback (`pd launch`, the official
`openai` client): with `--curve-keys` (made by `pd keygen`) completions equal those without;
strangers on the network (plain ZMQ, or CURVE with another keypair) get nothing from a node's
control or KV port (no answer, no work done, counters unchanged) while the router is still
served; every listening socket of every pd process is on 127.0.0.1; another local user (a
child that drops to `nobody`, where the tests run as root) can read neither `pd launch`'s keys
nor its rings and gets no answer from its nodes; and nodes and router, logging at debug level
without --log-requests, write neither a prompt's text nor its ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pd.wire import messages as m
from pd.service.procs import Launch
from pd.wire.sampling_params import SamplingParams
from pd.wire.security import CurveKeys
from pd.text.tokenizer import Tokenizer
from shm_ipc import header, records
from shm_ipc.segment import LINK, PREFIX, SEGMENT_HEADER, SHM_DIR

PROMPTS = ["def fibonacci(n):", "class Stack:"]
CANARY = "zebra_quartz_canary = 'hunter2'"
QUIET_S = 1.5  # how long a stranger waits for an answer that must not come


@dataclass
class NodeInfo:
    node_id: str
    pid: int
    control: str
    kv: str | None
    metrics: str
    log: str


def nodes(launch: Launch) -> dict[str, NodeInfo]:
    out = {}
    for line in launch.lines:
        g = re.match(r"node (\S+) pid (\d+) control (\S+)(?: kv (\S+))? metrics (\S+) log (\S+)",
                     line)
        if g:
            out[g[1]] = NodeInfo(g[1], int(g[2]), g[3], g[4], g[5], g[6])
    return out


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> CurveKeys:
    d = tmp_path_factory.mktemp("curve") / "keys"
    subprocess.run([sys.executable, "-m", "pd", "keygen", str(d)], check=True, timeout=60,
                   capture_output=True)
    return CurveKeys.load(d)


@pytest.fixture(scope="module")
def secured(tiny_model_dir, keys):
    launch = Launch(tiny_model_dir, "--num-blocks", "256", "--transport", "zmq",
                    "--curve-keys", keys.directory)
    yield launch
    assert launch.stop() == 0


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    launch = Launch(tiny_model_dir, "--num-blocks", "256", "--transport", "zmq",
                    "--log-level", "debug", "--insecure")
    yield launch
    assert launch.stop() == 0


def client(launch: Launch) -> openai.OpenAI:
    return openai.OpenAI(base_url=launch.url + "/v1", api_key="x", max_retries=0, timeout=60)


def complete(launch: Launch, prompt: str, stream: bool = False) -> str:
    api = client(launch)
    kw = dict(model=launch.served_model_name, prompt=prompt, max_tokens=12, temperature=0)
    if stream:
        return "".join(c.choices[0].text for c in api.completions.create(stream=True, **kw)
                       if c.choices)
    return api.completions.create(**kw).choices[0].text


def test_curve_keys_serve_the_same_completions(secured, plain, keys):
    for prompt in PROMPTS:
        want = complete(plain, prompt)
        assert want
        assert complete(secured, prompt) == want
        assert complete(secured, prompt, stream=True) == want
    for node in nodes(secured).values():  # pd launch passed the keys on
        assert flag(node.pid, "--curve-keys") == keys.directory


def flag(pid: int, name: str) -> str:
    """The value of the last `name` flag on the command line of process `pid`."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]




def counters(node: NodeInfo) -> dict:
    """The node's pd_* counters (requests, tokens, refusals, steps); idle, they hold still (not
    the host seconds by phase, which count time)."""
    text = httpx.get(f"http://{node.metrics}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("pd_") and s.name.endswith(("_total", "_count"))
            and s.name != "pd_decode_host_seconds_total"}


def dealer(addr: str, keys: tuple[bytes, bytes] | None, server_key: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    sock.connect(addr if addr.startswith("tcp://") else f"tcp://{addr}")
    return sock


def strangers():
    return {"plain": None, "other keypair": zmq.curve_keypair()}


def test_strangers_cannot_submit_work_to_a_prefill_node(secured, keys):
    ns = nodes(secured)
    prefill, decode = ns["prefill-0"], ns["decode-0"]
    before = counters(prefill)
    assert any(name == "pd_prompt_tokens_computed_total" for name, _ in before)
    for who, pair in strangers().items():
        sock = dealer(prefill.control, pair, keys.public_key)
        sock.send(m.encode(m.Ping(7)))
        sock.send(m.encode(m.PrefillRequest(
            uuid.uuid4().hex, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4).to_dict(),
            decode.kv, "tcp://127.0.0.1:9")))
        assert not sock.poll(QUIET_S * 1000), f"a {who} stranger got an answer"
        sock.close()
    assert counters(prefill) == before, "a stranger's request did work on the prefill node"
    sock = dealer(prefill.control, (keys.public_key, keys.secret_key), keys.public_key)
    sock.send(m.encode(m.Ping(8)))
    assert sock.poll(10_000) and isinstance(m.decode(sock.recv()), m.Pong)  # the keys do open it
    sock.close()
    assert complete(secured, PROMPTS[0]) == complete(secured, PROMPTS[0], stream=True) != ""


def test_strangers_cannot_inject_into_a_decode_node(secured, keys):
    decode = nodes(secured)["decode-0"]
    before = counters(decode)
    word, body = records.encode(records.FirstTokenRecord(uuid.uuid4().hex, 5, -0.5, 1, []))
    for who, pair in strangers().items():
        kv = dealer(decode.kv, pair, keys.public_key)
        kv.send(m.encode(m.Hello("intruder", {})))
        kv.send_multipart([header.to_bytes(word), body])
        control = dealer(decode.control, pair, keys.public_key)
        control.send(m.encode(m.Ping(9)))
        control.send(m.encode(m.Abort(uuid.uuid4().hex)))
        assert not kv.poll(QUIET_S * 1000), f"a {who} stranger got an answer on the KV port"
        assert not control.poll(0), f"a {who} stranger got an answer on the control port"
        kv.close()
        control.close()
    assert counters(decode) == before, "a stranger's message reached the decode node"
    kv = dealer(decode.kv, (keys.public_key, keys.secret_key), keys.public_key)
    kv.send(m.encode(m.Hello("holder-of-the-keys", {})))
    assert kv.poll(10_000) and isinstance(m.decode(kv.recv()), (m.HelloOk, m.HelloRefused))
    kv.close()
    assert complete(secured, PROMPTS[1])


def listening(pid: int) -> list[tuple[str, int]]:
    """(address as hex, port) of every listening TCP socket the process holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:
            continue
        if str(target).startswith("socket:["):
            inodes.add(str(target)[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                addr, port = cols[1].split(":")
                out.append((addr, int(port, 16)))
    return out


def test_every_listening_socket_is_on_loopback(secured):
    found = {}
    for pid in [secured.proc.pid, *(n.pid for n in nodes(secured).values())]:
        found[pid] = listening(pid)
    # router: HTTP + event socket; prefill: control + metrics; decode: control + KV + metrics
    assert sum(len(v) for v in found.values()) >= 7, found
    loopback = {"0100007F", "00000000000000000000000001000000"}
    assert all(addr in loopback for v in found.values() for addr, _ in v), found


def test_logs_hold_no_prompt(plain, tiny_model_dir):
    text = complete(plain, CANARY)
    ids = Tokenizer.from_dir(tiny_model_dir).encode(CANARY, add_special_tokens=False)
    assert len(ids) >= 5
    # the nodes' last log lines for the request: wait until their logs stop growing
    paths = [Path(node.log) for node in nodes(plain).values()]
    sizes, deadline = None, time.monotonic() + 5
    while time.monotonic() < deadline:
        now = [p.stat().st_size for p in paths]
        if now == sizes:
            break
        sizes = now
        time.sleep(0.1)
    logs = {"router": plain.output()}
    for node in nodes(plain).values():
        assert flag(node.pid, "--log-level") == "debug"
        logs[node.node_id] = Path(node.log).read_text(errors="replace")
    assert set(logs) == {"router", "prefill-0", "decode-0"}
    assert all(" INFO " in log for log in logs.values()), logs
    forms = [CANARY, "zebra_quartz", "hunter2", ", ".join(map(str, ids)),
             ",".join(map(str, ids)), " ".join(map(str, ids))]
    if len(text) > 8:
        forms.append(text)
    leaks = {name: f for name, log in logs.items() for f in forms if f in log}
    assert not leaks, f"prompt or completion in the logs: {leaks}"


def test_pd_launch_defaults_keep_strangers_out(shared_launch, plain):
    """Without --curve-keys pd launch makes CURVE keys of its own (0700, removed at the end):
    a local stranger's Ping on a node's control port gets no answer, plain or with a keypair
    of its own; with --insecure a plain Ping is answered."""
    fresh = zmq.curve_keypair()[0]  # a stranger cannot know the launch's server key
    for node in nodes(shared_launch).values():
        assert flag(node.pid, "--curve-keys").startswith(tempfile.gettempdir())
        for who, pair in strangers().items():
            sock = dealer(node.control, pair, fresh)
            sock.send(m.encode(m.Ping(3)))
            assert not sock.poll(QUIET_S * 1000), f"a {who} stranger got an answer from {node.node_id}"
            sock.close()
    node = nodes(plain)["prefill-0"]
    sock = dealer(node.control, None, b"")
    sock.send(m.encode(m.Ping(4)))
    assert sock.poll(10_000) and isinstance(m.decode(sock.recv()), m.Pong)
    sock.close()


# run as root, then as `nobody`: every path must be unreadable, every socket silent
_OTHER_USER = textwrap.dedent("""
    import json, os, sys
    import zmq
    paths, controls, ping, quiet_ms = json.loads(sys.argv[1])
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    out = {}
    for path in paths:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
            out[path] = "read"
        except PermissionError:
            out[path] = "denied"
    for addr in controls:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(addr)
        sock.send(bytes.fromhex(ping))
        out[addr] = "answered" if sock.poll(quiet_ms) else "silent"
        sock.close()
    print(json.dumps(out))
""")


def ring_segments(pids: set[int]) -> list[str]:
    """Paths of the shared-memory segments these processes created (told by their header): each
    segment's directory and the link in it."""
    out = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(PREFIX):
            continue
        try:
            with open(os.path.join(SHM_DIR, name, LINK), "rb") as f:
                raw = f.read(SEGMENT_HEADER.itemsize)
        except OSError:
            continue
        if len(raw) == SEGMENT_HEADER.itemsize:
            if int(np.frombuffer(raw, dtype=SEGMENT_HEADER)[0]["creator_pid"]) in pids:
                out += [os.path.join(SHM_DIR, name), os.path.join(SHM_DIR, name, LINK)]
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="a child can run as another uid (nobody) only "
                                                "when the tests run as root")
def test_another_local_user_reads_no_key_or_ring_and_gets_no_answer(shared_launch, plain):
    """pd launch's defaults against a local user of another uid; the same user's Ping to an
    --insecure launch's node is answered (what shows the Ping would have worked)."""
    # NOTE: the child imports what it needs as root, then drops to nobody (as _OTHER_USER does)
    probe = subprocess.run(
        [sys.executable, "-c", "import json, os, zmq; os.setgroups([]); os.setgid(65534); "
                               "os.setuid(65534); zmq.Context.instance().socket(zmq.DEALER).close()"],
        capture_output=True, text=True, timeout=60, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"a child cannot drop to nobody and use zmq here: "
                    f"{probe.stderr.strip().splitlines()[-1:]}")
    assert complete(shared_launch, PROMPTS[0])  # the prefill node's ring to the decode node exists
    ns = nodes(shared_launch)
    keys_dir = flag(ns["prefill-0"].pid, "--curve-keys")
    rings = ring_segments({n.pid for n in ns.values()})
    assert rings, "no ring segment of the launch found"
    paths = [keys_dir, os.path.join(keys_dir, "pd.key_secret"), *rings]

    def addr(node: NodeInfo) -> str:
        return node.control if node.control.startswith("tcp://") else f"tcp://{node.control}"

    secured_controls = [addr(n) for n in ns.values()]
    open_control = addr(nodes(plain)["prefill-0"])
    out = subprocess.run([sys.executable, "-c", _OTHER_USER,
                          json.dumps([paths, [*secured_controls, open_control],
                                      m.encode(m.Ping(5)).hex(), int(QUIET_S * 1000)])],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout)
    assert all(seen[p] == "denied" for p in paths), seen
    assert all(seen[a] == "silent" for a in secured_controls), seen
    assert seen[open_control] == "answered", seen
    assert complete(shared_launch, PROMPTS[1])  # the launch is unharmed
