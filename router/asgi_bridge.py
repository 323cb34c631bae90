"""A buffered ASGI call, for the router server's non-hot routes (health, metrics, models, admin).

`call_asgi(app, ...)` runs the FastAPI app on one request whose body is already read and returns the
whole answer (status, headers, body): these answers are small, so nothing is streamed. The app answers its
routes' errors itself (serving/errors.py); anything raised past it reaches the server's one catch-all
(router/server.py `RouterServer.dispatch`).
"""

from __future__ import annotations

from urllib.parse import unquote


async def call_asgi(app, method: bytes, path: bytes, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes, client: tuple, server: tuple) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": method.decode(), "scheme": "http", "path": unquote(path.decode("latin-1")),
             "raw_path": path, "query_string": query, "root_path": "", "headers": headers,
             "client": client, "server": server}
    is_body_read = False
    status, answer_headers, parts = 500, [], []

    async def receive() -> dict:
        nonlocal is_body_read
        if not is_body_read:
            is_body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, answer_headers
        if message["type"] == "http.response.start":
            status, answer_headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, answer_headers, b"".join(parts)
