"""A real HTTP server speaking the chat-completions protocol for tests: scripted replies, every
request recorded. Policies and agents under test talk to it as to vLLM or SGLang."""

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


class ChatServer:
    """POST /v1/chat/completions answering from a script of (status, body, delay) entries."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict, float]] = []
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
                status, reply, delay = server.script.pop(0) if server.script else (500, {"error": "script empty"}, 0)
                if delay:
                    server.stop.wait(delay)
                if status == 200:
                    reply = {"id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion",
                             "created": 0, "model": body["model"], **reply}
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
