"""Tests for ssr.suffix: brute-force reference for matches, continuations and counts; size bounds by counting.
And the prompt as suffix sources (ssr.proposals.SuffixSources): raw, and JSON-escaped where tools are bound."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssr.proposals import Context, SuffixSources
from ssr.suffix import Automaton, Proposal, SuffixIndex, Support

# --- brute-force reference ---------------------------------------------------------------------------------


def ends(hay, needle):
    """End positions of the occurrences of ``needle`` (non-empty) in ``hay``."""
    m = len(needle)
    return [e for e in range(m - 1, len(hay)) if list(hay[e - m + 1 : e + 1]) == list(needle)]


def continued_ends(hay, needle):
    return [e for e in ends(hay, needle) if e < len(hay) - 1]


def occurs(hay, needle) -> bool:
    return any(list(hay[i : i + len(needle)]) == list(needle) for i in range(len(hay) - len(needle) + 1))


def longest_match(toks, context, max_match):
    """Longest tail of ``context`` (<= max_match) that occurs in ``toks`` followed by a token."""
    for n in range(min(max_match, len(context)), 0, -1):
        if continued_ends(toks, context[-n:]):
            return n
    return 0


def reference(sources, context, max_tokens, min_match, min_prob, max_match):
    """``sources``: name -> tokens, in order of last modification (the last one is the most recent)."""
    best_key, best = None, None
    for tick, (name, toks) in enumerate(sources.items()):
        n = longest_match(toks, context, max_match)
        if n < max(min_match, 1):
            continue
        key = (n, len(continued_ends(toks, context[-n:])), tick)
        if best_key is None or key > best_key:
            best_key, best = key, (name, toks, n)
    if best is None:
        return Proposal([], None, 0)
    name, toks, n = best
    s, out, support = list(context[-n:]), [], []
    while len(out) < max_tokens:
        candidates = {toks[e + 1] for e in continued_ends(toks, s)}
        if not candidates:
            break
        window = s[-max_match:]
        score = {t: (len(ends(toks, window + [t])), max(ends(toks, window + [t]))) for t in candidates}
        t = max(candidates, key=score.__getitem__)
        seen = len(continued_ends(toks, window))
        if score[t][0] < min_prob * seen:
            break
        out.append(t)
        support.append(Support(score[t][0] / seen, seen))
        s.append(t)
    return Proposal(out, name, n, support)


def build(sources, max_match):
    index = SuffixIndex(max_match=max_match)
    for name, toks in sources.items():
        index.add(name, toks)
    return index


# --- property tests ----------------------------------------------------------------------------------------

tokens = st.lists(st.integers(0, 2), max_size=40)
source_sets = st.lists(tokens, min_size=1, max_size=3).map(lambda ls: {f"s{i}": t for i, t in enumerate(ls)})
params = dict(
    context=st.lists(st.integers(0, 2), max_size=25),
    max_tokens=st.integers(0, 8),
    min_match=st.integers(0, 4),
    min_prob=st.sampled_from([0.0, 0.1, 0.34, 0.5, 0.7, 1.0]),
    max_match=st.integers(1, 7),
)


@settings(max_examples=300, deadline=None)
@given(sources=source_sets, **params)
def test_matches_brute_force(sources, context, max_tokens, min_match, min_prob, max_match):
    got = build(sources, max_match).propose(context, max_tokens, min_match=min_match, min_prob=min_prob)
    # The match is a longest one, and the proposal a true continuation of it in the named source.
    want_len = max((longest_match(t, context, max_match) for t in sources.values()), default=0)
    assert got.match_len == (want_len if want_len >= max(min_match, 1) else 0)
    if got.source is None:
        assert got.tokens == [] and got.match_len == 0
    else:
        assert occurs(sources[got.source], list(context[-got.match_len :]) + got.tokens)
        assert len(got.tokens) <= max_tokens
    # Exactly the documented rule (tie-breaks and stopping included), each token's support as counted
    want = reference(sources, context, max_tokens, min_match, min_prob, max_match)
    assert got == want and got.support == want.support


@st.composite
def sessions(draw):
    """Interleaved source extensions and queries with a context that mostly grows (sometimes it is replaced)."""
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            steps.append(("extend", f"s{draw(st.integers(0, 2))}", draw(st.lists(st.integers(0, 2), max_size=8))))
        elif draw(st.integers(0, 4)) == 0:
            steps.append(("reset", draw(st.lists(st.integers(0, 2), max_size=12))))
        else:
            steps.append(("grow", draw(st.lists(st.integers(0, 2), max_size=6))))
    return steps


@settings(max_examples=100, deadline=None)
@given(steps=sessions(), max_match=st.integers(1, 6), max_tokens=st.integers(0, 6), min_prob=st.sampled_from([0, 0.3]))
def test_incremental_equals_built_at_once(steps, max_match, max_tokens, min_prob):
    index = SuffixIndex(max_match=max_match)
    sources: dict[str, list[int]] = {}  # kept in order of last modification, like the index's recency
    context: list[int] = []
    for step in steps:
        if step[0] == "extend":
            _, name, toks = step
            (index.add if name not in sources else index.extend)(name, toks)
            if name not in sources or toks:
                sources[name] = sources.pop(name, []) + toks
        else:
            context = step[1] if step[0] == "reset" else context + step[1]
        got = index.propose(context, max_tokens, min_prob=min_prob)  # uses the memo of the previous query
        fresh = build(sources, max_match).propose(context, max_tokens, min_prob=min_prob)
        assert got == fresh


@settings(max_examples=60, deadline=None)
@given(sources=source_sets, context=st.lists(st.integers(0, 2), max_size=40), max_match=st.integers(1, 4))
def test_context_growing_token_by_token(sources, context, max_match):
    """The common decoding case: fixed sources, one more context token per query (the incremental matcher)."""
    index = build(sources, max_match)
    for i in range(len(context) + 1):
        got = index.propose(context[:i], 3, min_match=1)
        assert got == build(sources, max_match).propose(context[:i], 3, min_match=1)
        assert got == reference(sources, context[:i], 3, 1, 0.1, max_match)


@settings(max_examples=100, deadline=None)
@given(toks=st.lists(st.integers(0, 2), max_size=60), max_match=st.integers(1, 5))
def test_counts_exact_up_to_max_match_plus_one(toks, max_match):
    a = Automaton(max_match)
    for t in toks:
        a.append(t)
    window = toks[-(max_match + 1) :]
    state = 0
    for t in window:
        state = a.next[state][t]
    assert (a.win, a.win_len) == (state, len(window))
    for n in range(1, max_match + 2):
        for s in {tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)}:
            state = 0
            for t in s:
                state = a.next[state][t]
            assert a.cnt[state] == len(ends(toks, s))
            assert a.lastpos[state] == max(ends(toks, s))


# --- unit tests --------------------------------------------------------------------------------------------


def test_empty_index_and_empty_source():
    assert SuffixIndex().propose([1, 2, 3], 5) == Proposal([], None, 0)
    index = SuffixIndex()
    index.add("prompt")
    assert index.propose([], 5) == Proposal([], None, 0)
    assert index.propose([1, 2, 3], 5) == Proposal([], None, 0)


def test_no_match():
    index = SuffixIndex()
    index.add("prompt", [1, 2, 3, 4])
    assert index.propose([7, 8, 9], 5) == Proposal([], None, 0)


def test_simple_copy():
    index = SuffixIndex()
    index.add("prompt", [5, 1, 2, 3, 4, 6, 7])
    assert index.propose([9, 9, 1, 2], 3) == Proposal([3, 4, 6], "prompt", 2)


def test_min_match_respected():
    index = SuffixIndex()
    index.add("prompt", [1, 2, 3, 4, 5])
    assert index.propose([9, 3], 4).source is None  # only one token matches
    assert index.propose([9, 3], 4, min_match=1) == Proposal([4, 5], "prompt", 1)
    assert index.propose([2, 3], 4, min_match=3).source is None


def test_max_tokens_and_max_match_respected():
    index = SuffixIndex(max_match=3)
    index.add("prompt", list(range(100)))
    got = index.propose([10, 11, 12, 13, 14], 4)
    assert got == Proposal([15, 16, 17, 18], "prompt", 3)
    assert index.propose([10, 11, 12], 0) == Proposal([], "prompt", 3)


def test_longest_match_wins_across_sources():
    index = SuffixIndex()
    index.add("prompt", [1, 2, 3, 40, 41])
    index.add("thinking", [0, 1, 2, 3, 50, 51])
    index.add("draft:0", [2, 3, 60, 61])
    assert index.propose([0, 1, 2, 3], 2) == Proposal([50, 51], "thinking", 4)
    assert index.propose([7, 1, 2, 3], 2).match_len == 3  # prompt and thinking tie on length and count
    assert index.propose([7, 1, 2, 3], 2).source == "thinking"  # ... the more recent source wins
    index.extend("prompt", [9])
    assert index.propose([7, 1, 2, 3], 2).source == "prompt"


def test_more_frequent_match_wins_tie():
    index = SuffixIndex()
    index.add("a", [1, 2, 3, 1, 2, 3])
    index.add("b", [1, 2, 4])
    assert index.propose([1, 2], 1) == Proposal([3], "a", 2)


def test_match_at_the_very_end_is_skipped():
    """The text being generated is often a source itself: its tail always 'matches' there, with nothing to copy."""
    index = SuffixIndex()
    index.add("thinking", [1, 2, 3, 4, 5, 6])
    index.add("answer", [7, 8, 1, 2, 3])
    assert index.propose([7, 8, 1, 2, 3], 3) == Proposal([4, 5, 6], "thinking", 3)
    index.extend("answer", [4, 5])
    assert index.propose([7, 8, 1, 2, 3, 4, 5], 3) == Proposal([6], "thinking", 5)


def test_ambiguous_continuation_stops_early():
    index = SuffixIndex()
    # After [1, 2]: 3 follows three times; after [1, 2, 3]: 4 / 5 / 6 once each.
    index.add("thinking", [1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2, 3, 6, 0])
    assert index.propose([1, 2], 5, min_prob=0.5) == Proposal([3], "thinking", 2)
    assert index.propose([1, 2], 5, min_prob=0.3) == Proposal([3, 6, 0], "thinking", 2)  # ties: most recent; then the source ends
    assert index.propose([1, 2], 5, min_prob=0.0).tokens == [3, 6, 0]


def test_unlikely_first_token_gives_empty_proposal():
    index = SuffixIndex()
    index.add("thinking", [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6])
    assert index.propose([1, 2], 4, min_prob=0.5) == Proposal([], "thinking", 2)


def test_extend_unknown_source_raises_and_add_extends():
    index = SuffixIndex()
    with pytest.raises(KeyError):
        index.extend("nope", [1])
    index.add("answer", [1, 2])
    index.add("answer", [3, 4])
    assert index.propose([1, 2], 5) == Proposal([3, 4], "answer", 2)


def test_growing_context_and_sources():
    index = SuffixIndex(max_match=4)
    index.add("thinking", [1, 2, 3, 4, 5, 6, 7, 8])
    index.add("answer")
    context = []
    for t in [1, 2, 3, 4, 5]:
        context.append(t)
        index.extend("answer", [t])
        got = index.propose(context, 2)
        want = [] if len(context) < 2 else [t + 1, t + 2]
        assert got.tokens == want


# --- size / work bounds (counts only, never wall time) -----------------------------------------------------


def chain_length(a: Automaton, state: int) -> int:
    n = 0
    while state != -1:
        n, state = n + 1, a.link[state]
    return n


@pytest.mark.parametrize("pattern", [[0], [0, 1], [0, 1, 2, 1], list(range(50))])
def test_states_linear_and_count_walk_bounded(pattern):
    max_match = 8
    a = Automaton(max_match)
    n = 3000
    for i in range(n):
        a.append(pattern[i % len(pattern)])
        # The counts walk of each append visits at most max_match + 2 states, even on a loop like "aaaa...".
        assert chain_length(a, a.win) <= max_match + 2
    assert len(a.length) <= 2 * n
    assert sum(map(len, a.next)) <= 3 * n


def test_states_linear_on_pseudo_random_text():
    a = Automaton(32)
    x, n = 12345, 5000
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        a.append(x % 7)
    assert len(a.length) <= 2 * n
    assert sum(map(len, a.next)) <= 3 * n


# -- the prompt's sources (ssr.proposals.SuffixSources) --------------------------------------------------------------

FILE = 'def is_palindrome(s):\n    """Ignore "case"."""\n    s = s.lower()\n    return s == s[::-1]\n'
CALL_SO_FAR = ('{"name": "write_file", "arguments": {"path": "pal.py", '
               '"content": "def is_palindrome(s):\\n    \\"\\"\\"Ignore')


def _sources(tokenizer, tools: bool):
    prompt = tokenizer.encode(f"<tool_response>\n{FILE}</tool_response>\n", add_special_tokens=False)
    sources = SuffixSources(("prompt", "thinking"), max_tokens=64, min_match=2, min_prob=0.1)
    sources.add_prompt(prompt, tokenizer, tools=tools)
    return sources, Context(tokenizer.encode(CALL_SO_FAR, add_special_tokens=False))


def test_a_call_copying_the_prompt_into_a_json_string_gets_the_escaped_rest(tokenizer):
    sources, context = _sources(tokenizer, tools=True)
    found = sources.propose(context, room=64)
    assert found is not None and found.source == "prompt-json"
    rest = json.dumps(FILE)[1:-1].split("Ignore", 1)[1]
    proposed = tokenizer.decode(found.tokens)
    assert len(proposed) > 12 and rest.startswith(proposed)  # past the escaped quotes and newlines


def test_the_escaped_view_needs_tools_and_loses_ties_to_the_raw_prompt(tokenizer):
    sources, _ = _sources(tokenizer, tools=False)
    assert "prompt-json" not in sources.index._sources
    sources, _ = _sources(tokenizer, tools=True)
    both = tokenizer.encode("Thinking: def is_palindrome(s", add_special_tokens=False)  # a tail both views hold
    found = sources.propose(Context(both), room=64)
    assert found is not None and found.source == "prompt"  # the thinking quotes the file raw
    assert tokenizer.decode(found.tokens).startswith("):\n    \"\"\"Ignore")


@pytest.mark.parametrize("factor, proposed", [(1.0, 2), (2.5, 5), (3.0, 6), (100.0, 16)])
def test_a_match_of_n_tokens_proposes_at_most_factor_times_n(factor, proposed):
    sources = SuffixSources(("prompt",), max_tokens=16, min_match=1, min_prob=0.1, spec_factor=factor)
    sources.extend("prompt", list(range(40)))
    found = sources.propose(Context([99, 5, 6]), room=64)  # "5 6" matches: 2 tokens
    assert found is not None and found.match_len == 2
    assert found.tokens == list(range(7, 7 + proposed))  # max_tokens bounds the widest


def test_the_spec_factor_and_min_match_are_checked():
    from ssr import SSRConfig

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="suffix_max_spec_factor"):
            SSRConfig(suffix_max_spec_factor=bad)
    with pytest.raises(TypeError, match="suffix_max_spec_factor"):
        SSRConfig(suffix_max_spec_factor="3")
    with pytest.raises(ValueError, match="suffix_min_match"):
        SSRConfig(suffix_min_match=0)
