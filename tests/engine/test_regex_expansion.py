"""`pd.engine.regex_expansion`: the rewritten regex matches the same strings (Python's `re` on
every short string over the regex's letters), and what the parser does not follow is left as it
is. That xgrammar allows the same tokens under both is `tests/engine/test_grammar_state.py`'s."""

from __future__ import annotations

import itertools
import re

import pytest

from pd.engine.regex_expansion import expand_plus

REGEXES = ["[a-c]+", "a{1,}", "a{2,}b", "a{3,}", "(ab|c)+x", "(?P<g>a)+b", "a+?b", "((a)+b)+",
           "x\\++", "[]a]+b", "(?:ab|c){3,}", "[^x]+", "a{2,4}", "b*a?", "(?=a)a+", "(?i)a+b"]


@pytest.mark.parametrize("regex", REGEXES)
def test_expand_plus_keeps_the_regexs_language(regex):
    """`expand_plus` (A+ as AA*, A{n,} as n copies of A then A*) matches exactly the strings
    the regex does, every string of up to 6 characters over the regex's letters and two
    others."""
    expanded = expand_plus(regex)
    assert "+" not in expanded.replace("\\+", "") and "{1,}" not in expanded
    for length in range(7):
        for chars in itertools.product("abcx+]", repeat=length):
            text = "".join(chars)
            assert (re.fullmatch(regex, text) is None) == (re.fullmatch(expanded, text) is None), \
                (regex, expanded, text)


def test_expand_plus_rewrites_only_what_it_parses():
    assert expand_plus("[a-z0-9 ,.()=+]+") == "[a-z0-9 ,.()=+][a-z0-9 ,.()=+]*"
    assert expand_plus("[a-z]{3,}") == "[a-z][a-z][a-z][a-z]*"  # not the slower [a-z]{3}[a-z]*
    assert expand_plus("a{17,}") == "a{17,}"  # past MAX_UNROLL: as fast as written
    assert expand_plus("(a)+\\1") == "(a)+\\1"  # a backreference: a copy would renumber
    for broken in ("(ab", "a\\", "[ab"):
        assert expand_plus(broken) == broken
