"""A regex in the form xgrammar matches fast: `expand_plus` writes every `A+` as `AA*`.

xgrammar compiles `A+` into a right-recursive rule (`r ::= A r | A`); when such a rule is the
whole grammar its matcher fills a mask over a 128k-token vocabulary in 260-720 us, against 3-8
us for the same language written `AA*` (`[a-z0-9 ,.()=+]+` 520-720 us, `[a-z]+` 260, `([a-z]+)`
431; xgrammar 0.2.8 alone on a 2-core CPU, a byte-level BPE of 128,256 trained tokens); `A{n,}`
likewise, written out as n copies (a counted `A{n}` is slower still).
`pd.engine.grammar.Grammars` compiles every regex spec through it. A small parser of Python's
regex syntax: escapes, classes (a `]` first, POSIX classes), groups (flags, named, lookarounds),
quantifiers; what it does not follow it leaves as it is.
"""

from __future__ import annotations

import re

# A{n,} is unrolled up to this n: `[a-z]{3,}` filled in 240 us, `[a-z]{3}[a-z]*` in 3.7 ms at
# its start, `[a-z][a-z][a-z][a-z]*` in 3 us; from 16 on xgrammar's own form was as fast (4 us)
MAX_UNROLL = 16


def expand_plus(regex: str) -> str:
    """The same regex with every `A+` written `AA*` (`A+?` as `AA*?`) and every `A{n,}` as n
    copies of A then `A*` (n up to `MAX_UNROLL`), the copies of a group non-capturing; one
    this does not parse, or with backreferences (which a copied group would renumber), as it
    is."""
    if re.search(r"\\[1-9]|\(\?P=", regex):
        return regex
    try:
        out, end = _expand(regex, 0, "")
    except ValueError:
        return regex
    return out if end == len(regex) else regex


def _expand(s: str, i: int, stop: str) -> tuple[str, int]:
    """`expand_plus` of s[i:] up to the unmatched `stop` (")" inside a group): the text and
    where it ended."""
    out: list[str] = []
    atom = None  # the last atom's text, while a quantifier may follow it
    while i < len(s) and s[i] != stop:
        c, j = s[i], i + 1
        if c == "\\":
            j = _escape_end(s, i)
        elif c == "[":
            j = _class_end(s, i)
        elif c == "(":
            head = re.match(r"\((?:\?(?:[:=!>]|<[=!]|P?<\w+>|[aiLmsux-]+[:)]))?", s[i:]).group()
            if head.endswith(")"):  # inline flags: no group
                out.append(head)
                i, atom = i + len(head), None
                continue
            inner, j = _expand(s, i + len(head), ")")
            if j >= len(s):
                raise ValueError("unbalanced group")
            j += 1
            out.append(head + inner + ")")
            if head[2:3] in ("=", "!") or head[2:4] in ("<=", "<!"):
                atom = None  # a lookaround: nothing to repeat
            elif head == "(" or head.startswith(("(?P<", "(?<")):
                atom = "(?:" + inner + ")"  # the copy does not capture again
            else:
                atom = out[-1]
            i = j
            continue
        elif c in "+{":
            # A+ is A{1,}; A{n,} (n <= MAX_UNROLL) becomes n copies of A then A*
            m = re.match(r"\+|\{(\d*)(,?)(\d*)\}", s[i:])
            j = i + m.end() if m else j
            n = 1 if c == "+" else int(m[1]) if m and m[1] and m[2] and not m[3] else 0
            if atom is not None and 1 <= n <= MAX_UNROLL:
                lazy = s[j:j + 1] == "?"
                out.append(atom * n + ("*?" if lazy else "*"))  # after the atom's own text
                i, atom = j + lazy, None
                continue
        text = s[i:j]
        out.append(text)
        atom = None if c in "*?{|+^$" else text
        i = j
    return "".join(out), i


def _escape_end(s: str, i: int) -> int:
    """End of the escape at s[i] ("\\")."""
    m = re.match(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[pPN]\{[^}]*\}|.)", s[i:],
                 re.S)
    if m is None:
        raise ValueError("a lone backslash")
    return i + m.end()


def _class_end(s: str, i: int) -> int:
    """End of the character class at s[i] ("[")."""
    j = i + 1
    if s[j:j + 1] == "^":
        j += 1
    if s[j:j + 1] == "]":  # a "]" first is a literal
        j += 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == "]":
            return j + 1
        elif s.startswith("[:", j):
            j = s.index(":]", j) + 2
        else:
            j += 1
    raise ValueError("unterminated class")
