"""Policies: what chooses a rollout's next tool call.

:class:`ReplayPolicy` replays recorded (or generated) traces with a think time per step that
stands in for generation latency, reproducible from a seed. :class:`OpenAIPolicy` asks any
OpenAI-compatible chat-completions server with tool calling (vLLM, SGLang, OpenAI) through the
``openai`` client.

Both implement the :class:`~bunshin.rl.types.Policy` protocol: ``await policy.act(history)``
returns the next :class:`~bunshin.cache.toolcall.ToolCall` or a :class:`~bunshin.rl.types.Final`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cache.errors import InvalidToolCall
from ..cache.toolcall import ToolCall, as_tool_call
from .types import Completion, Final, History, PolicyError, RolloutError

__all__ = ["BUILTIN_TOOL_SCHEMAS", "OpenAIPolicy", "PolicyStats", "ReplayPolicy"]


# -- replay -------------------------------------------------------------------------------

ThinkTime = float | Callable[[int], float]


def _unit(seed: int, task_id: str, index: int, step: int) -> float:
    """A number in [-1, 1] that depends only on its arguments (blake2b, not ``hash()``)."""
    key = json.dumps([seed, task_id, index, step], separators=(",", ":")).encode()
    n = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    return 2.0 * n / (2**64 - 1) - 1.0


def _check_seconds(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise RolloutError(f"{what} must be a finite number of seconds ≥ 0, got {v!r}")
    return float(v)


def _as_trace(trace: object, i: int) -> tuple[ToolCall, ...]:
    if isinstance(trace, (str, bytes)) or not isinstance(trace, Iterable):
        hint = " (a trace of one command is a list: [cmd])" if isinstance(trace, str) else ""
        raise RolloutError(f"ReplayPolicy: trace {i} must be a sequence of ToolCall or str "
                           f"(bash command), got {type(trace).__name__}{hint}")
    out = []
    for j, call in enumerate(trace):
        try:
            out.append(as_tool_call(call))
        except InvalidToolCall as e:
            raise RolloutError(f"ReplayPolicy: trace {i} call {j}: {e}") from None
    return tuple(out)


class ReplayPolicy:
    """Replays traces: rollout ``history.index`` plays ``traces[index % len(traces)]``.

    At step ``len(history.turns)`` it answers that trace's call number ``step``, and
    :class:`Final` once the trace is exhausted. Before answering it sleeps ``think_s * (1 +
    jitter * u)`` seconds (``asyncio.sleep``), ``u`` uniform in [-1, 1] drawn from
    ``(seed, task.id, index, step)`` only, so the same rollout thinks the same time on every run.
    ``think_s`` may be a function of the step (``think_s(step) -> seconds``), e.g. to make the
    first step's prompt processing slower. The Final answer also sleeps (the model's last turn).

    >>> pol = ReplayPolicy([["ls", "cat README"], ["ls"]], think_s=0.5, jitter=0.2, seed=1)
    """

    def __init__(self, traces: Sequence[Sequence[ToolCall | str]], *, think_s: ThinkTime = 0.0,
                 jitter: float = 0.0, seed: int = 0) -> None:
        if isinstance(traces, (str, bytes)) or not isinstance(traces, Iterable):
            raise RolloutError(f"ReplayPolicy: traces must be a sequence of traces, got {type(traces).__name__}")
        self.traces: tuple[tuple[ToolCall, ...], ...] = tuple(_as_trace(t, i) for i, t in enumerate(traces))
        if not self.traces:
            raise RolloutError("ReplayPolicy: traces is empty; give at least one trace (it may be empty)")
        if not callable(think_s):
            think_s = _check_seconds(think_s, "ReplayPolicy: think_s")
        self.think_s = think_s
        if (isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not math.isfinite(jitter)
                or not 0 <= jitter <= 1):
            raise RolloutError(f"ReplayPolicy: jitter must be a number in [0, 1] (a fraction of think_s), "
                               f"got {jitter!r}")
        self.jitter = float(jitter)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise RolloutError(f"ReplayPolicy: seed must be an int, got {seed!r}")
        self.seed = seed

    def __repr__(self) -> str:
        return (f"ReplayPolicy({len(self.traces)} traces, think_s={self.think_s!r}, "
                f"jitter={self.jitter}, seed={self.seed})")

    def trace(self, index: int) -> tuple[ToolCall, ...]:
        """The trace rollout ``index`` replays."""
        return self.traces[index % len(self.traces)]

    def think_time(self, task_id: str, index: int, step: int) -> float:
        """Seconds rollout ``index`` of ``task_id`` thinks before answering step ``step``."""
        base = self.think_s(step) if callable(self.think_s) else self.think_s
        base = _check_seconds(base, f"ReplayPolicy: think_s({step})")
        if base == 0.0 or self.jitter == 0.0:
            return base
        return max(0.0, base * (1.0 + self.jitter * _unit(self.seed, task_id, index, step)))

    async def act(self, history: History) -> ToolCall | Final:
        """The trace's next call after the think time; :class:`Final` when it is exhausted."""
        step = len(history.turns)
        trace = self.trace(history.index)
        delay = self.think_time(history.task.id, history.index, step)
        if delay > 0:
            await asyncio.sleep(delay)
        return trace[step] if step < len(trace) else Final()

    # -- files ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, **kwargs: Any) -> ReplayPolicy:
        """Traces from a JSONL file: one trace per line, a JSON list of ``[name, args]`` pairs
        (a bare string is a bash command). Blank lines are skipped. ``kwargs`` go to the
        constructor (think_s, jitter, seed)."""
        traces = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    items = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RolloutError(f"{path}:{lineno}: not JSON: {e}") from None
                if not isinstance(items, list):
                    raise RolloutError(f"{path}:{lineno}: a trace must be a JSON list, got {type(items).__name__}")
                trace: list[ToolCall | str] = []
                for j, item in enumerate(items):
                    if isinstance(item, str):
                        trace.append(item)
                    elif isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict):
                        try:
                            trace.append(ToolCall(item[0], item[1]))
                        except InvalidToolCall as e:
                            raise RolloutError(f"{path}:{lineno}: call {j}: {e}") from None
                    else:
                        raise RolloutError(f"{path}:{lineno}: call {j} must be [name, {{args}}] or a "
                                           f"bash command string, got {item!r}")
                traces.append(trace)
        return cls(traces, **kwargs)

    def save(self, path: str | os.PathLike) -> None:
        """Write the traces as JSONL (the format :meth:`load` reads), atomically."""
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps([[c.name, c.args] for c in trace], ensure_ascii=False) + "\n"
                         for trace in self.traces)
        os.replace(tmp, path)


# -- OpenAI-compatible servers ------------------------------------------------------------

def _fn(name: str, description: str, props: dict[str, str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {k: {"type": "string", "description": d} for k, d in props.items()},
                       "required": list(props), "additionalProperties": False}}}


BUILTIN_TOOL_SCHEMAS: dict[str, dict] = {
    "bash": _fn("bash", "Run a bash command in a persistent shell in the workspace (cd and variables "
                "persist between calls). Returns its output (stderr merged) and exit code.",
                {"command": "The bash command to run."}),
    "read_file": _fn("read_file", "Read a file of the workspace.", {"path": "Absolute path of the file."}),
    "write_file": _fn("write_file", "Create or overwrite a file of the workspace (parent directories "
                      "are created).", {"path": "Absolute path of the file.", "content": "The file's new text."}),
    "python": _fn("python", "Run a Python 3 program (python3 -c) in the workspace; returns its output.",
                  {"code": "The Python source to run."}),
}
"""OpenAI ``tools`` entries for the built-in tools of :mod:`bunshin.cache.tools`."""

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent working in a Linux workspace. Use the tools to inspect and change it and to "
    "complete the user's task, one tool call per reply. When you are done, reply without a tool "
    "call; that reply is your final answer.")

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "boolean": (bool,), "array": (list,), "object": (dict,),
    "null": (type(None),),
}


@dataclass
class PolicyStats:
    """Counters of an :class:`OpenAIPolicy` (all requests, every rollout).

    ``requests``: HTTP requests sent (retries included); ``retries``: requests repeated after a
    server error, a timeout or an unusable reply; ``bad_replies``: replies with malformed or
    unknown tool calls; ``failures``: ``act`` calls that raised :class:`PolicyError`;
    ``gen_s``: total seconds of successful requests; ``latencies_s``: each successful request's
    seconds, in order; ``extra_tool_calls``: tool calls dropped because a reply held several.
    """

    requests: int = 0
    replies: int = 0
    retries: int = 0
    bad_replies: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    extra_tool_calls: int = 0
    gen_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The counters as a JSON-ready dict (latencies summarised: count, mean, max)."""
        lat = self.latencies_s
        d = {k: getattr(self, k) for k in ("requests", "replies", "retries", "bad_replies", "failures",
                                           "prompt_tokens", "completion_tokens", "total_tokens",
                                           "extra_tool_calls", "gen_s")}
        d["latency_mean_s"] = sum(lat) / len(lat) if lat else 0.0
        d["latency_max_s"] = max(lat) if lat else 0.0
        return d


class _BadReply(Exception):
    """The server answered, but not with something :meth:`OpenAIPolicy.act` can use."""


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} characters omitted ...]\n"
    head = limit // 2
    return text[:head] + note + text[len(text) - (limit - head):]


class OpenAIPolicy:
    """A policy served by an OpenAI-compatible chat-completions endpoint with tool calling.

    Each ``act`` sends the whole conversation: the system prompt, the task's prompt as the user
    message, then for every turn an assistant message with its one tool call (id ``call_<step>``,
    stable) and a tool message with the observation (at most ``max_observation_chars``: head and
    tail kept; a non-zero exit code is appended as ``[exit code N]``). ``tools`` offered: the
    schemas of the task's ``tools`` (built-ins from :data:`BUILTIN_TOOL_SCHEMAS`; ``tools=``
    adds or overrides schemas by name; a task tool with no schema is an error).

    A reply with a tool call becomes a :class:`ToolCall` (the first one when there are several;
    the others are counted in ``stats.extra_tool_calls``); a reply without one becomes
    ``Final(content)``.

    Failures: server errors (5xx, 429), connection errors and timeouts (``timeout`` seconds per
    request) are retried, and so is a *bad reply* — tool-call arguments that are not a JSON
    object, miss a required argument, or name a tool the task does not offer — which is
    re-sampled. After ``max_retries`` retries (with ``backoff_s * 2**attempt`` seconds between
    them) ``act`` raises :class:`PolicyError`, naming the last problem: the engine records a
    failed rollout rather than an answer the model never gave. Other HTTP errors (400, 401,
    404: a wrong model name, a context overflow) raise at once.

    ``seed``: when given, requests carry ``seed + history.index + 100003 * history.group``
    (servers that honour it make each rollout reproducible, the group diverse, and a batch's
    groups of one task apart from each other). ``extra_body`` is merged into every
    request (e.g. ``{"top_k": 20}`` for vLLM). Token usage and latencies go to ``self.stats``.

    For training, each reply used is kept as a :class:`~bunshin.rl.types.Completion` in
    ``history.completions`` (the rollout engine puts it in the turn and the trajectory): the messages and
    tools exactly as sent and the reply. ``token_ids=True`` asks for the prompt's and the
    completion's token ids (``return_token_ids`` and ``return_prompt_token_ids`` in the body:
    vLLM ≥ 0.10.2 answers the first with ``prompt_token_ids`` beside ``choices`` and ignores the
    second, with a warning in its log; SGLang answers both inside the choice);
    ``logprobs=True`` asks for each completion token's logprob, ``top_logprobs=k`` for the k
    likeliest alternatives too. A server that leaves out what was asked for raises
    :class:`PolicyError` at once: a trainer must not get a trajectory without them.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str = "EMPTY",
                 temperature: float = 1.0, top_p: float = 1.0, max_tokens: int | None = 1024,
                 timeout: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5,
                 system_prompt: str | None = None, tools: Mapping[str, dict] | None = None,
                 extra_body: Mapping[str, Any] | None = None, max_observation_chars: int = 16_000,
                 seed: int | None = None, tool_choice: str | None = None, token_ids: bool = False,
                 logprobs: bool = False, top_logprobs: int | None = None) -> None:
        if not isinstance(base_url, str) or not base_url:
            raise RolloutError(f"OpenAIPolicy: base_url must be a URL str, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise RolloutError(f"OpenAIPolicy: model must be a non-empty str, got {model!r}")
        for name, v, lo, hi in (("temperature", temperature, 0.0, 2.0), ("top_p", top_p, 0.0, 1.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise RolloutError(f"OpenAIPolicy: {name} must be a number in [{lo}, {hi}], got {v!r}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise RolloutError(f"OpenAIPolicy: max_tokens must be an int ≥ 1 or None, got {max_tokens!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise RolloutError(f"OpenAIPolicy: timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise RolloutError(f"OpenAIPolicy: max_retries must be an int ≥ 0, got {max_retries!r}")
        backoff_s = _check_seconds(backoff_s, "OpenAIPolicy: backoff_s")
        if (isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int)
                or max_observation_chars < 64):
            raise RolloutError(f"OpenAIPolicy: max_observation_chars must be an int ≥ 64, "
                               f"got {max_observation_chars!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RolloutError(f"OpenAIPolicy: seed must be an int or None, got {seed!r}")
        for name, flag in (("token_ids", token_ids), ("logprobs", logprobs)):
            if not isinstance(flag, bool):
                raise RolloutError(f"OpenAIPolicy: {name} must be a bool, got {flag!r}")
        if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                         or not 0 <= top_logprobs <= 20):
            raise RolloutError(f"OpenAIPolicy: top_logprobs must be an int in [0, 20] or None, got {top_logprobs!r}")
        if top_logprobs and not logprobs:
            raise RolloutError("OpenAIPolicy: top_logprobs needs logprobs=True")
        schemas = dict(BUILTIN_TOOL_SCHEMAS)
        for name, schema in (tools or {}).items():
            if not isinstance(schema, Mapping):
                raise RolloutError(f"OpenAIPolicy: tools[{name!r}] must be an OpenAI tool dict, got {schema!r}")
            fn = schema.get("function", schema)
            if not isinstance(fn, Mapping) or fn.get("name", name) != name:
                raise RolloutError(f"OpenAIPolicy: tools[{name!r}] must be {{'type': 'function', "
                                   f"'function': {{'name': {name!r}, 'parameters': ...}}}}, got {schema!r}")
            schemas[name] = {"type": "function", "function": {"name": name, **fn}}
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_tokens = max_tokens
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.schemas = schemas
        self.extra_body = dict(extra_body or {})
        self.max_observation_chars = max_observation_chars
        self.seed = seed
        self.tool_choice = tool_choice
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.stats = PolicyStats()
        self._clients: dict[int, Any] = {}  # id(event loop) -> AsyncOpenAI (its pool is per loop)

    def __repr__(self) -> str:
        return f"OpenAIPolicy({self.base_url!r}, {self.model!r})"

    # -- the request ------------------------------------------------------------------
    def tools_for(self, history: History) -> list[dict]:
        """The ``tools`` offered for ``history.task`` (its tools, in its order)."""
        missing = [t for t in history.task.tools if t not in self.schemas]
        if missing:
            raise PolicyError(f"task {history.task.id!r} offers tool(s) {missing} that have no JSON "
                              f"schema; pass OpenAIPolicy(tools={{name: schema}}) (known: {sorted(self.schemas)})")
        return [self.schemas[t] for t in history.task.tools]

    def messages(self, history: History) -> list[dict]:
        """The chat messages for ``history`` (see the class docstring)."""
        msgs: list[dict] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": history.task.prompt})
        for step, turn in enumerate(history.turns):
            cid = f"call_{step}"
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": cid, "type": "function",
                "function": {"name": turn.call.name,
                             "arguments": json.dumps(turn.call.args, ensure_ascii=False)}}]})
            obs = _truncate(turn.observation, self.max_observation_chars)
            if turn.exit_code != 0:
                obs += f"\n[exit code {turn.exit_code}]"
            msgs.append({"role": "tool", "tool_call_id": cid, "content": obs})
        return msgs

    def request(self, history: History) -> dict[str, Any]:
        """The keyword arguments of ``chat.completions.create`` for ``history``."""
        kw: dict[str, Any] = {"model": self.model, "messages": self.messages(history),
                              "temperature": self.temperature, "top_p": self.top_p}
        tools = self.tools_for(history)
        if tools:
            kw["tools"] = tools
            if self.tool_choice is not None:
                kw["tool_choice"] = self.tool_choice
        if self.max_tokens is not None:
            kw["max_tokens"] = self.max_tokens
        if self.seed is not None:
            # groups of one task in a batch draw apart; group 0 keeps the single group's seeds
            kw["seed"] = self.seed + history.index + history.group * 100_003
        if self.logprobs:
            kw["logprobs"] = True
            if self.top_logprobs:
                kw["top_logprobs"] = self.top_logprobs
        body = dict(self.extra_body)
        if self.token_ids:
            body.update(return_token_ids=True, return_prompt_token_ids=True)
        if body:
            kw["extra_body"] = body
        return kw

    def _client(self) -> Any:
        import openai

        loop = asyncio.get_running_loop()
        c = self._clients.get(id(loop))
        if c is None or c[0] is not loop:
            c = (loop, openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                          timeout=self.timeout, max_retries=0))
            self._clients = {k: v for k, v in self._clients.items() if not v[0].is_closed()}
            self._clients[id(loop)] = c
        return c[1]

    # -- the reply --------------------------------------------------------------------
    def _parse(self, resp: Any, history: History) -> ToolCall | Final:
        if not getattr(resp, "choices", None):
            raise _BadReply("the reply has no choices")
        msg = resp.choices[0].message
        calls = msg.tool_calls or []
        if not calls:
            return Final(msg.content or "")
        self.stats.extra_tool_calls += len(calls) - 1
        fn = calls[0].function
        name = fn.name
        if name not in history.task.tools:
            raise _BadReply(f"the model called tool {name!r}, which the task does not offer "
                            f"({list(history.task.tools)})")
        try:
            args = json.loads(fn.arguments or "{}")
        except json.JSONDecodeError as e:
            raise _BadReply(f"tool {name!r}: arguments are not JSON ({e}): {fn.arguments[:200]!r}") from None
        if not isinstance(args, dict):
            raise _BadReply(f"tool {name!r}: arguments must be a JSON object, got {fn.arguments[:200]!r}")
        params = self.schemas[name]["function"].get("parameters") or {}
        props = params.get("properties") or {}
        missing = [k for k in params.get("required", ()) if k not in args]
        if missing:
            raise _BadReply(f"tool {name!r}: missing required argument(s) {missing}")
        if params.get("additionalProperties") is False:
            extra = sorted(set(args) - set(props))
            if extra:
                raise _BadReply(f"tool {name!r}: unknown argument(s) {extra}; expected {sorted(props)}")
        for k, v in args.items():
            want = _JSON_TYPES.get((props.get(k) or {}).get("type", ""))
            if want and (not isinstance(v, want) or (want == (int,) and isinstance(v, bool))):
                raise _BadReply(f"tool {name!r}: argument {k!r} must be a JSON {props[k]['type']}, got {v!r}")
        try:
            return ToolCall(name, args)
        except InvalidToolCall as e:
            raise _BadReply(str(e)) from None

    def _completion(self, resp: Any, kw: dict[str, Any]) -> Completion:
        """The reply ``resp`` to request ``kw`` as a Completion; PolicyError when it lacks the
        token ids or logprobs asked for."""
        choice = resp.choices[0]
        msg = choice.message
        prompt_ids = ids = lps = tokens = top = None
        if self.token_ids:
            # vLLM puts the prompt's ids beside the choices, SGLang inside the choice
            prompt_ids = _ints(getattr(resp, "prompt_token_ids", None) or getattr(choice, "prompt_token_ids", None))
            ids = _ints(getattr(choice, "token_ids", None))
            if prompt_ids is None or ids is None:
                raise PolicyError(f"{self.base_url} (model {self.model!r}) returned no "
                                  f"{'prompt_token_ids' if prompt_ids is None else 'token_ids'} although asked "
                                  "(return_token_ids): use vLLM ≥ 0.10.2 or SGLang, or token_ids=False")
        if self.logprobs:
            content = getattr(getattr(choice, "logprobs", None), "content", None)
            if content is None:
                raise PolicyError(f"{self.base_url} (model {self.model!r}) returned no logprobs although "
                                  "asked (logprobs=True)")
            lps = [float(c.logprob) for c in content]
            tokens = [c.token for c in content]
            if self.top_logprobs:
                top = [{t.token: float(t.logprob) for t in (c.top_logprobs or [])} for c in content]
            if ids is not None and len(ids) != len(lps):
                raise PolicyError(f"{self.base_url} (model {self.model!r}) returned {len(ids)} completion token "
                                  f"ids but {len(lps)} logprobs: they must pair up")
        u = getattr(resp, "usage", None)
        return Completion(
            messages=kw["messages"], tools=kw.get("tools", []), content=msg.content,
            tool_calls=[c.model_dump() if hasattr(c, "model_dump") else dict(c) for c in msg.tool_calls or []],
            finish_reason=choice.finish_reason, prompt_token_ids=prompt_ids, completion_token_ids=ids,
            logprobs=lps, tokens=tokens, top_logprobs=top,
            usage={k: getattr(u, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
                   if isinstance(getattr(u, k, None), int)} if u is not None else None)

    def _count_usage(self, resp: Any) -> None:
        u = getattr(resp, "usage", None)
        if u is not None:
            self.stats.prompt_tokens += u.prompt_tokens or 0
            self.stats.completion_tokens += u.completion_tokens or 0
            self.stats.total_tokens += u.total_tokens or 0

    async def act(self, history: History) -> ToolCall | Final:
        """Ask the server for the next step of ``history`` (see the class docstring)."""
        import openai

        kw = self.request(history)
        client = self._client()
        problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats.retries += 1
                if self.backoff_s:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.stats.requests += 1
            t0 = time.monotonic()
            try:
                resp = await client.chat.completions.create(**kw)
            except openai.APITimeoutError:
                problem = f"no reply within {self.timeout:g} s"
                continue
            except openai.APIConnectionError as e:
                problem = f"cannot reach {self.base_url}: {e.__cause__ or e}"
                continue
            except openai.APIStatusError as e:
                if e.status_code == 429 or e.status_code >= 500:
                    problem = f"server error {e.status_code}: {_short(e)}"
                    continue
                self.stats.failures += 1
                raise PolicyError(f"{self.base_url} refused the request (HTTP {e.status_code}, model "
                                  f"{self.model!r}): {_short(e)}") from None
            dt = time.monotonic() - t0
            self.stats.replies += 1
            self.stats.gen_s += dt
            self.stats.latencies_s.append(dt)
            self._count_usage(resp)
            try:
                action = self._parse(resp, history)
            except _BadReply as e:
                self.stats.bad_replies += 1
                problem = f"unusable reply: {e}"
                continue
            try:
                history.completions.append(self._completion(resp, kw))
            except PolicyError:
                self.stats.failures += 1
                raise
            return action
        self.stats.failures += 1
        raise PolicyError(f"task {history.task.id!r} rollout {history.index} step {len(history.turns)}: "
                          f"no usable reply from {self.base_url} (model {self.model!r}) after "
                          f"{self.max_retries + 1} attempt(s); last: {problem}")

    async def aclose(self) -> None:
        """Close the HTTP client of the running event loop (others are dropped)."""
        c = self._clients.pop(id(asyncio.get_running_loop()), None)
        self._clients.clear()
        if c is not None:
            await c[1].close()


def _ints(v: Any) -> list[int] | None:
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    return None


def _short(e: Exception) -> str:
    text = str(getattr(e, "message", "") or e)
    return text if len(text) <= 300 else text[:300] + "..."
