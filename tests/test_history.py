"""Earlier requests' outputs as a suffix source (ssr.history): bounded, never spans two outputs, exact."""

from __future__ import annotations

from ssr import SSRConfig
from ssr.history import SEPARATOR, OutputHistory
from ssr.proposals import Context, SuffixSources
from tiny import prompt_ids, tiny_engine

HISTORY_ONLY = dict(max_drafts=0, suffix_sources=("history",), max_think_tokens=12, max_tokens=48)


def sources_over(history: OutputHistory) -> SuffixSources:
    sources = SuffixSources(("prompt", "history"), max_tokens=16, min_match=2, min_prob=0.1)
    sources.attach_history(history)
    return sources


def test_an_earlier_output_is_proposed_up_to_its_end():
    history = OutputHistory()
    history.add([1, 2, 3, 4, 5])
    history.add([7, 8, 9])
    found = sources_over(history).propose(Context(tail=[0, 1, 2]), room=16)
    assert found is not None and found.source == "history"
    assert found.tokens == [3, 4]  # capped at the match length (SuffixDecoding's rule)
    found = sources_over(history).propose(Context(tail=[2, 3, 4]), room=16)
    assert found.tokens == [5]  # and never past the output's end into the next one
    assert SEPARATOR not in found.tokens


def test_the_history_is_bounded_and_keeps_the_newest_outputs():
    history = OutputHistory(max_tokens=20)
    for start in range(0, 50, 5):
        history.add(list(range(start, start + 5)))  # 6 tokens held per output, separator included
    assert history._size <= 20 and len(history) >= 1
    assert sources_over(history).propose(Context(tail=[45, 46, 47]), room=16).tokens == [48, 49]
    assert sources_over(history).propose(Context(tail=[0, 1, 2]), room=16) is None  # the oldest are gone
    history.add(list(range(100, 150)))  # longer than half the room: its tail is kept, alone
    assert history._outputs[-1] == list(range(141, 150)) and history._size <= 20
    assert sources_over(history).propose(Context(tail=[141, 142]), room=16).tokens == [143, 144]
    history.clear()
    assert len(history) == 0 and sources_over(history).propose(Context(tail=[45, 46]), room=16) is None


def test_no_history_is_kept_at_zero_tokens():
    history = OutputHistory(max_tokens=0)
    history.add([1, 2, 3])
    assert len(history) == 0


def test_a_repeated_request_copies_its_earlier_output_and_stays_exact():
    """The second time a prompt comes, the first output is proposed from the history: fewer passes, same tokens.
    Plain decoding reads no history and adds none."""
    engine = tiny_engine(1, attention=0.4, scale=0.5)
    prompt = prompt_ids("abc\nde")
    budgets = {k: HISTORY_ONLY[k] for k in ("max_think_tokens", "max_tokens")}
    plain = engine.generate(prompt, config=SSRConfig(enabled=False, **budgets))
    assert len(engine.history) == 0
    first = engine.generate(prompt, config=SSRConfig(**HISTORY_ONLY))
    again = engine.generate(prompt, config=SSRConfig(**HISTORY_ONLY))
    assert len(engine.history) == 2 and first.token_ids == again.token_ids == plain.token_ids
    assert "history" not in first.stats["accepted_by_source"]
    assert again.stats["accepted_by_source"].get("history", 0) >= len(plain.token_ids) // 2
    assert again.stats["forward_passes"] < first.stats["forward_passes"]


def test_an_engine_without_history_proposes_nothing_from_it():
    engine = tiny_engine(1, attention=0.4, scale=0.5)
    engine.history = OutputHistory(max_tokens=0)
    prompt = prompt_ids("abc\nde")
    first = engine.generate(prompt, config=SSRConfig(**HISTORY_ONLY))
    again = engine.generate(prompt, config=SSRConfig(**HISTORY_ONLY))
    assert again.token_ids == first.token_ids
    assert "history" not in again.stats["accepted_by_source"]
