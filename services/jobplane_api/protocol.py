"""The API's HTTP/1.1 protocol: uvicorn's (httptools), except that a request it cannot parse
(a malformed request line or header, a bad ``Content-Length``) is answered with problem+json,
as every other error of the API is, instead of uvicorn's text/plain. Such a request never
reaches the application."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from jobplane_api.problems import PROBLEM_JSON, problem


class ProblemHttpProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        # As uvicorn's own (its default headers, then close the connection: what follows the
        # unparsable request cannot be trusted), with a problem for a body.
        body = bytes(problem(400, "Bad Request", msg).body)
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                f"content-type: {PROBLEM_JSON}\r\n".encode(),
                f"content-length: {len(body)}\r\n".encode(),
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()
