"""A real HTTP server speaking the chat-completions protocol for tests: scripted replies, every
request recorded. Policies and agents under test talk to it as to vLLM or SGLang.

Asked for them, it answers with token ids and logprobs the way vLLM (``flavor="vllm"``) or
SGLang (``"sglang"``) does, or, as a server that has no token ids (``"plain"``), with logprobs
only. Its tokenizer is UTF-8 bytes: a token id is a byte, the prompt is
the JSON of the request's messages (:func:`prompt_text`), a completion is its content or its
first tool call as ``name(arguments)`` (:func:`completion_text`), and token i's logprob is
``-(id % 7 + 1) / 10``, so a test can check every id and logprob it was given.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def tool_reply(name: str, arguments: str, *, n: int = 1, content=None) -> dict:
    return {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": content,
        "tool_calls": [{"id": f"srv_{i}", "type": "function",
                        "function": {"name": name, "arguments": arguments}} for i in range(n)]}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}}


def text_reply(content: str) -> dict:
    return {"choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55}}


def prompt_text(body: dict) -> str:
    """What the test tokenizer reads of a request: its messages as compact JSON."""
    return json.dumps(body["messages"], separators=(",", ":"), ensure_ascii=False)


def completion_text(message: dict) -> str:
    """What the test tokenizer reads of a reply message."""
    calls = message.get("tool_calls") or []
    if calls:
        return f"{calls[0]['function']['name']}({calls[0]['function']['arguments']})"
    return message.get("content") or ""


def logprob_of(token_id: int) -> float:
    return -((token_id % 7) + 1) / 10


def _with_tokens(reply: dict, body: dict, flavor: str) -> dict:
    """``reply`` with the token ids and logprobs ``body`` asks for, in ``flavor``'s form."""
    if not (body.get("logprobs") or body.get("return_token_ids")):
        return reply
    prompt_ids = list(prompt_text(body).encode())
    reply = dict(reply)
    choices = []
    for ch in reply.get("choices", []):
        ch = dict(ch)
        ids = list(completion_text(ch.get("message") or {}).encode())
        if body.get("logprobs"):
            k = body.get("top_logprobs") or 0
            ch["logprobs"] = {"content": [
                {"token": bytes([i]).decode("latin-1"), "logprob": logprob_of(i), "bytes": [i],
                 "top_logprobs": [{"token": bytes([(i + j) % 256]).decode("latin-1"),
                                   "logprob": logprob_of(i) - j, "bytes": [(i + j) % 256]} for j in range(k)]}
                for i in ids]}
        if body.get("return_token_ids") and flavor in ("vllm", "sglang"):
            ch["token_ids"] = ids
            if flavor == "sglang" and body.get("return_prompt_token_ids"):
                ch["prompt_token_ids"] = prompt_ids
        choices.append(ch)
    reply["choices"] = choices
    if flavor == "vllm" and body.get("return_token_ids"):
        reply["prompt_token_ids"] = prompt_ids
    return reply


class ChatServer:
    """POST /v1/chat/completions answering from a script of (status, body, delay) entries, then
    from ``responder(request body) -> (status, body, delay)`` when one is set (replies that
    depend on the conversation, for concurrent rollouts). ``flavor``: the form of token ids."""

    def __init__(self, flavor: str = "vllm") -> None:
        self.script: list[tuple[int, dict, float]] = []
        self.responder = None
        self.flavor = flavor
        self.requests: list[dict] = []
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                        "body": body})
                if server.script:
                    status, reply, delay = server.script.pop(0)
                elif server.responder is not None:
                    status, reply, delay = server.responder(body)
                else:
                    status, reply, delay = 500, {"error": "script empty"}, 0
                if delay:
                    server.stop.wait(delay)
                if status == 200:
                    reply = {"id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion",
                             "created": 0, "model": body["model"], **_with_tokens(reply, body, server.flavor)}
                data = json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout test)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def reply(self, body: dict, *, status: int = 200, delay: float = 0.0) -> None:
        self.script.append((status, body, delay))

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
