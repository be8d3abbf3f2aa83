"""The methods compared: named ``SSRConfig`` variants of one engine, plus peers that replay plain decoding's length
with their own decoding loop: transformers' prompt lookup, and on the vLLM backend vLLM's plain, ngram and suffix
decoding (``vllm_peers``).

Every method of a suite starts from the same base config (budgets: ``max_think_tokens``, ``min_think_tokens``,
``draft_start``, ``max_tokens``, ...), so outputs are comparable token for token.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from ssr.config import SUFFIX_SOURCES, SSRConfig

PLAIN = "plain"
BARE = "bare"  # the model's own chat template, no thinking: the reference for tool-use quality, not for speed
PROMPT_LOOKUP = "prompt-lookup"
VLLM_PEERS = ("vllm", "vllm-ngram", "vllm-suffix")
LLAMA_CPP = "llama.cpp"  # plain llama.cpp: Llama.generate (llama_cpp_peer), on the llama.cpp backend
# llama.cpp's own server, plain and with its draft-free speculation (llama_server), on the llama.cpp backend
# (each also as NAME-q8: the server on the file the engine loaded, its Q5_0-as-Q8_0 copy where the engine chose it, so
# the weights' gain and speculation's can be told apart; the plain names run the file as users have it)
ON_ENGINE_WEIGHTS = "-q8"
LLAMA_SERVER_PEERS = tuple(name + weights for weights in ("", ON_ENGINE_WEIGHTS)
                           for name in ("llama-server", "llama-server-ngram-mod", "llama-server-ngram-map-k"))
LLAMA_CPP_PEERS = (LLAMA_CPP,) + LLAMA_SERVER_PEERS
METHODS = ("plain", "suffix", "ssr-prefix", "ssr", "ssr-iterative", "prompt-lookup", BARE) + VLLM_PEERS + LLAMA_CPP_PEERS
# peers with their own decoding loop: they generate plain's number of tokens from the same prompt ids
REPLAY = (PROMPT_LOOKUP,) + VLLM_PEERS + LLAMA_CPP_PEERS
DEFAULT_METHODS = ("plain", "suffix", "ssr-prefix", "ssr", "ssr-iterative", "prompt-lookup")
# methods that must reproduce plain decoding's token ids exactly (greedy); prompt-lookup is compared too, but it
# cannot replay the engine's forced text (budget forcing), so it is expected to match only where none was forced
EXACT = ("suffix", "ssr-prefix", "ssr", "ssr-iterative")
PROMPT_LOOKUP_TOKENS = 10

DESCRIPTIONS = {
    "plain": "plain greedy decoding through the same backend (SSRConfig(enabled=False))",
    "suffix": "peer: suffix decoding everywhere (thinking and answer) over prompt, thinking, own output and earlier "
              "outputs (SuffixDecoding's global cache, its proposal cap: max_spec_factor 1), no drafts",
    "ssr-prefix": "SSR drafts, longest verified prefix only (no suffix proposals anywhere)",
    "ssr": "SSR: drafts + prefix acceptance + suffix proposals from drafts, prompt, thinking, answer, earlier outputs",
    "ssr-iterative": "SSR with a new (bootstrapped) draft every draft_interval thinking tokens",
    "bare": "the model without SSR's thinking recipe (its own chat template, no thinking), plain decoding",
    "prompt-lookup": f"transformers generate(prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS}), same prompt ids, "
                     "max_new_tokens = plain's output length",
    "vllm": "plain vLLM decoding (LLM.generate, its own loop), same prompt ids, plain's output length",
    "vllm-ngram": "vLLM's ngram prompt-lookup speculative decoding (8 tokens, n-grams 2-4), plain's output length",
    "vllm-suffix": "vLLM's suffix decoding (Arctic Inference, 16 tokens), plain's output length",
    "llama.cpp": "plain llama.cpp (llama-cpp-python Llama.generate, greedy, its own loop), same GGUF and prompt ids, "
                 "plain's output length",
    "llama-server": "llama.cpp's llama-server (a real server process, same GGUF and threads, same source and flags as "
                    "the backend), plain greedy, plain's prompt ids and output length",
    "llama-server-ngram-mod": "llama-server with --spec-type ngram-mod (its draft-free speculation; n-gram pool "
                              "shared across requests), greedy, plain's prompt ids and output length",
    "llama-server-ngram-map-k": "llama-server with --spec-type ngram-map-k, greedy, plain's prompt ids and output "
                                "length",
}
DESCRIPTIONS |= {name + ON_ENGINE_WEIGHTS: DESCRIPTIONS[name] + "; on the file the engine loaded (its Q5_0-as-Q8_0 "
                 "copy where chosen) instead of the GGUF as shipped"
                 for name in LLAMA_SERVER_PEERS if name in DESCRIPTIONS}


def iterative_interval(base: SSRConfig) -> int:
    """draft_interval for ``ssr-iterative`` when the base config sets none: about three drafts over the budget."""
    if base.draft_interval:
        return base.draft_interval
    span = max(base.max_think_tokens - base.draft_start, 1)
    return max(8, span // 3)


def method_config(name: str, base: SSRConfig) -> SSRConfig | None:
    """The config of method ``name`` derived from ``base`` (None for the ``REPLAY`` peers, which bypass the
    engine)."""
    if name in (PLAIN, BARE):
        return base.override(enabled=False)
    if name == "suffix":
        return base.override(enabled=True, max_drafts=0, suffix_decoding=True, prefix_accept=False,
                             suffix_sources=("prompt", "thinking", "answer", "history"), suffix_max_spec_factor=1.0)
    if name == "ssr-prefix":
        return base.override(enabled=True, suffix_decoding=False, prefix_accept=True, max_drafts=max(base.max_drafts, 1),
                             think_speculation=False, draft_speculation=False)
    if name == "ssr":
        return base.override(enabled=True, suffix_decoding=True, prefix_accept=True,
                             suffix_sources=SUFFIX_SOURCES,
                             max_drafts=max(base.max_drafts, 1))
    if name == "ssr-iterative":
        return base.override(enabled=True, suffix_decoding=True, prefix_accept=True,
                             suffix_sources=SUFFIX_SOURCES,
                             draft_interval=iterative_interval(base), max_drafts=max(base.max_drafts, 2),
                             bootstrap_drafts=True)
    if name in REPLAY:
        return None
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def backend_methods(backend: str) -> tuple[str, ...]:
    """Every method that runs on ``backend``: the peers are tied to their backend's model (``all``)."""
    peers = {"vllm": VLLM_PEERS, "transformers": (PROMPT_LOOKUP,), "llama.cpp": LLAMA_CPP_PEERS}.get(backend, ())
    return tuple(m for m in METHODS if m not in REPLAY or m in peers)


def parse_methods(spec: str | list[str] | tuple[str, ...] | None, backend: str = "transformers") -> list[str]:
    """A comma list (or list) of method names, ``plain`` always first (the others compare against it); ``all``:
    every method that runs on ``backend``."""
    if spec is None:
        names = list(DEFAULT_METHODS)
    elif isinstance(spec, str):
        names = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        names = [s.strip() for part in spec for s in str(part).split(",") if s.strip()]
    if names == ["all"]:
        names = list(backend_methods(backend))
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    elsewhere = [n for n in names if n not in backend_methods(backend)]
    if elsewhere:
        raise ValueError(f"method(s) {elsewhere} do not run on backend {backend!r} (vllm* peers: --backend vllm; "
                         "prompt-lookup: --backend transformers; llama.cpp, llama-server*: --backend llama.cpp)")
    out = [PLAIN] + [n for n in dict.fromkeys(names) if n != PLAIN]
    return out


def token_hash(ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


@dataclass
class Outcome:
    """One generation, whatever ran it."""

    token_ids: list[int]
    answer: str
    tool_calls: list[dict[str, Any]]
    latency_s: float
    ttfa_s: float | None  # wall time to the first answer text
    stats: dict[str, Any]
    finish_reason: str | None = None
    reasoning: str = ""
    # greedy on a backend whose rows depend on the batch: positions where other tokens came within the near-tie
    # window -> [(token, margin), ...] (``GenerationResult.near_ties``; ``ssr.agreement``)
    near_ties: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


def forced_sequences(engine) -> list[list[int]]:
    """Token ids of the text the engine forces (budget forcing): the close text and the "continue" text."""
    family = getattr(engine, "family", None)
    out = []
    for text in (getattr(family, "close_text", None), getattr(family, "continue_text", None)):
        if text:
            try:
                out.append(list(engine.tokenizer.encode(text, add_special_tokens=False)))
            except Exception:  # noqa: BLE001
                pass
    return [s for s in out if s]


def diverged_at_forced_text(plain_ids: list[int], at: int | None, forced: list[list[int]]) -> bool:
    """Whether plain's tokens at ``at`` start a forced sequence (text generate() cannot produce by itself)."""
    if at is None:
        return False
    return any(seq and plain_ids[at: at + len(seq)] == seq for seq in forced)


def run_engine(engine, item: dict[str, Any], config: SSRConfig, thinking: bool | None = None) -> Outcome:
    """One generation of ``item`` on the engine with ``config``; wall time measured around the whole call."""
    t0 = time.perf_counter()
    ttfa = None
    result = None
    for event in engine.stream(item["messages"], tools=item.get("tools"), tool_choice=item.get("tool_choice"),
                               config=config, thinking=thinking):
        if event.kind == "answer" and ttfa is None and event.text:
            ttfa = time.perf_counter() - t0
        elif event.kind == "done":
            result = event.result
    latency = time.perf_counter() - t0
    assert result is not None
    return Outcome(token_ids=list(result.token_ids), answer=result.answer, tool_calls=list(result.tool_calls),
                   latency_s=latency, ttfa_s=ttfa, stats=dict(result.stats), finish_reason=result.finish_reason,
                   reasoning=result.reasoning, near_ties=dict(result.near_ties))


def run_langchain_tools(engine, item: dict[str, Any], config: SSRConfig) -> Outcome:
    """A tool-calling item the way an agent runs it: ``ChatSSR(...).bind_tools(tools, tool_choice=...).invoke``.

    The adapter is a thin layer over the same engine, so the outcome carries the engine's token ids and stats (from
    the message's response metadata) and compares with plain decoding token for token.
    """
    from langchain_ssr import ChatSSR

    llm = ChatSSR(engine=engine, ssr_config=config).bind_tools(item["tools"], tool_choice=item.get("tool_choice"))
    t0 = time.perf_counter()
    message = llm.invoke(item["messages"])
    latency = time.perf_counter() - t0
    meta = message.response_metadata
    stats = dict(meta["ssr"])
    return Outcome(token_ids=list(meta["token_ids"]), answer=message.text,
                   tool_calls=[{"name": c["name"], "arguments": c["args"]} for c in message.tool_calls],
                   latency_s=latency, ttfa_s=stats.get("time_to_first_answer_token"), stats=stats,
                   finish_reason=meta.get("finish_reason"),
                   reasoning=message.additional_kwargs.get("reasoning_content", ""),
                   near_ties=dict(meta.get("near_ties") or {}))


class PromptLookupPeer:
    """transformers' own prompt lookup decoding (``generate(prompt_lookup_num_tokens=...)``) on the engine's model,
    behind the replay peers' interface (``vllm_peers.VLLMPeer``)."""

    def __init__(self, engine, num_tokens: int = PROMPT_LOOKUP_TOKENS) -> None:
        self.engine, self.num_tokens = engine, num_tokens

    def generate(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy, at most ``max_tokens`` new tokens (EOS ends it): ``{"token_ids", "seconds"}``."""
        import torch

        model = self.engine.backend.model
        input_ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
        eos = sorted(getattr(self.engine.backend, "eos_token_ids", []) or [])
        pad = getattr(self.engine.backend, "pad_token_id", None)
        kwargs: dict[str, Any] = {"max_new_tokens": max(1, max_tokens), "do_sample": False,
                                  "prompt_lookup_num_tokens": self.num_tokens,
                                  "attention_mask": torch.ones_like(input_ids)}
        if eos:
            kwargs["eos_token_id"] = eos
        if pad is not None:
            kwargs["pad_token_id"] = pad

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids, temperature=None, top_p=None, top_k=None, **kwargs)
            return {"token_ids": out[0, len(prompt_ids):].tolist(), "seconds": time.perf_counter() - t0}

        # on the engine's thread, in the OpenMP team its steps use: on this thread it would start a second team, and
        # libgomp would slow both from then on (ssr.threads)
        return self.engine.run_on_engine_thread(run)


def _answer_text(engine, text: str, item: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A replay peer's answer and tool calls: the text after the close marker, split as the transcript does."""
    marker = getattr(getattr(engine, "family", None), "think_close", "</think>")
    answer = text.split(marker, 1)[1].lstrip() if marker in text else ""
    tool_calls: list[dict[str, Any]] = []
    if item.get("tools") and answer:
        try:
            from ssr.chat import parse_tool_calls

            tool_calls = parse_tool_calls(answer, item["tools"]).tool_calls
        except Exception:  # noqa: BLE001 - scoring only
            tool_calls = []
    return answer, tool_calls


def forced_text(plain: dict[str, Any]) -> list[tuple[int, list[int]]]:
    """Plain decoding's forced text (budget forcing's close and continue text, a forced answer opening): each
    span's index in plain's tokens and its tokens."""
    ids = plain.get("token_ids") or []
    return [(int(at), ids[at:at + n]) for at, n in plain.get("forced_spans") or [] if at + n <= len(ids)]


def generate_with_forced(peer, ids: list[int], max_tokens: int,
                         forced: list[tuple[int, list[int]]]) -> dict[str, Any]:
    """``max_tokens`` tokens from a peer whose decoding loop cannot insert text, with plain decoding's forced text
    inserted where plain inserted it: the peer decodes up to a span, the span's tokens are appended to the context,
    and it goes on from there, reusing its cache (``peer.keeps_prefix``: each continuation prefills only the tokens
    added since the last call, as plain decoding feeds forced text in one batch). The peer then does plain's work,
    forced text included, and where its tokens equal plain's it decodes plain's output."""
    tokens: list[int] = []
    seconds, parts = 0.0, []
    for at, span in [*forced, (max_tokens, [])]:
        if at > len(tokens):
            out = peer.generate(ids + tokens, at - len(tokens), reuse_cache=bool(tokens))
            parts.append(out)
            seconds += out["seconds"]
            tokens += out["token_ids"]
            if len(tokens) < at:  # the peer stopped early: nothing to line the span up with
                break
        tokens += span
    return {"token_ids": tokens[:max_tokens], "seconds": seconds, "steps": None,
            "prefill_s": parts[0].get("prefill_s") if parts else None, "calls": len(parts),
            **({"server": parts[0]["server"]} if parts and "server" in parts[0] else {})}


def run_peer(peer, engine, item: dict[str, Any], max_tokens: int,
             forced: list[tuple[int, list[int]]] | None = None) -> Outcome:
    """A peer with its own decoding loop (``vllm_peers.VLLMPeer``, ``llama_cpp_peer.LlamaCppPeer``,
    ``PromptLookupPeer``: one interface) on the engine's prompt ids, ``max_tokens`` greedy tokens; with plain's
    ``forced`` text inserted where plain inserted it, for the peers that keep their cache between calls."""
    ids = engine.encode(item["messages"], tools=item.get("tools"), tool_choice=item.get("tool_choice"))
    if forced and getattr(peer, "keeps_prefix", False):
        out = generate_with_forced(peer, ids, max(1, max_tokens), forced)
    else:
        out = peer.generate(ids, max(1, max_tokens))
    new = out["token_ids"]
    answer, tool_calls = _answer_text(engine, engine.tokenizer.decode(new, skip_special_tokens=True), item)
    return Outcome(token_ids=new, answer=answer, tool_calls=tool_calls, latency_s=out["seconds"], ttfa_s=None,
                   stats={"new_tokens": len(new), "forward_passes": out.get("steps"),
                          "prefill_s": out.get("prefill_s"), **({"server": out["server"]} if "server" in out else {})})


def replay_agent(peer, plain: dict[str, Any]) -> Outcome:
    """A peer with its own decoding loop cannot run a tool loop; on the agent suite it replays plain decoding's
    steps instead: each step's prompt ids, plain's number of tokens. Greedy makes the loop deterministic, so where
    the peer's tokens equal plain's this is the work it would do in the loop (the record says whether they do)."""
    token_ids: list[int] = []
    steps, seconds = [], 0.0
    for step in plain["steps"]:
        out = peer.generate(step["prompt_ids"], max(1, step["n_tokens"]))
        token_ids += out["token_ids"]
        seconds += out["seconds"]
        steps.append({"latency_s": round(out["seconds"], 4), "n_tokens": len(out["token_ids"]),
                      "forward_passes": out.get("steps"), "prompt_tokens": len(step["prompt_ids"])})
    return Outcome(token_ids=token_ids, answer="", tool_calls=[], latency_s=seconds, ttfa_s=None,
                   stats={"steps": steps, "forward_passes": sum(s["forward_passes"] or 0 for s in steps) or None})


def run_agent(engine, item: dict[str, Any], config: SSRConfig, front: str = "engine",
              max_steps: int | None = None) -> Outcome:
    """One task of the agent suite, run as a whole tool loop through ``front``; latency is the task's end to end,
    the token ids are every step's, and ``stats["steps"]`` holds each step's numbers."""
    from . import agent

    outcome = agent.LOOPS[front](engine, agent.TASKS_BY_ID[item["task"]], config, max_steps or agent.MAX_STEPS)
    if any(not s.token_ids for s in outcome.steps):  # never compare runs that carry nothing to compare
        raise RuntimeError(f"the {front} front gave a step without its token ids")
    stats = agent.aggregate_stats(outcome.steps)
    stats.update(solved=outcome.solved, steps=[agent.step_summary(s) for s in outcome.steps])
    last = outcome.steps[-1] if outcome.steps else None
    return Outcome(token_ids=outcome.token_ids, answer=last.answer if last else "",
                   tool_calls=[{"name": c["name"], "arguments": c["arguments"]} for s in outcome.steps
                               for c in s.tool_calls],
                   latency_s=outcome.latency_s, ttfa_s=None, stats=stats, near_ties=outcome.near_ties)
