"""Nothing is pickled: no module of the code imports or calls pickle, marshal, shelve or the
pickling sockets (`send_pyobj`/`recv_pyobj`), nor unpickling loaders (`torch.load`,
`allow_pickle`). Identifiers are checked, not comments or docstrings, which may say "never
unpickles"."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pd", "router", "prefill_node", "decode_node", "shm_ipc", "pd_kernels", "tools",
            "benchmarks")
BANNED = re.compile(r"pickle|marshal|shelve|_pyobj|^dill$|^joblib$", re.IGNORECASE)


def offences(source: str) -> list[str]:
    """`line: what` for each banned identifier (or `torch.load` call) in `source`."""
    found = []
    names = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type in (tokenize.NAME, tokenize.OP)]
    for i, tok in enumerate(names):
        if tok.type != tokenize.NAME:
            continue
        if BANNED.search(tok.string):
            found.append(f"{tok.start[0]}: {tok.string}")
        elif tok.string == "load" and i >= 2 and names[i - 1].string == "." \
                and names[i - 2].string == "torch":
            found.append(f"{tok.start[0]}: torch.load")
    return found


def code_files() -> list[Path]:
    return sorted(f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py"))


def test_the_check_finds_what_it_must():
    bad = ("import pickle\nfrom marshal import loads\nimport shelve\nimport cPickle\n"
           "sock.send_pyobj(x)\nx = s.recv_pyobj()\nnp.load(f, allow_pickle=True)\n"
           "torch.load(path)\nimport dill\n")
    assert len(offences(bad)) == bad.count("\n")
    ok = '"""Nothing is pickled; never unpickles."""\n# no pickle here\nx = "marshal"\n'
    assert offences(ok) == []


def test_no_pickle_anywhere():
    files = code_files()
    assert len(files) > 50 and any(f.name == "messages.py" for f in files)
    found = {str(f.relative_to(ROOT)): o for f in files if (o := offences(f.read_text()))}
    assert not found, f"pickling in the code: {found}"
