"""A local stand-in for the Hugging Face Hub: the endpoints ``huggingface_hub`` calls for
``model_info`` and ``hf_hub_download``, on a threaded ``http.server`` bound to 127.0.0.1
(point ``HF_ENDPOINT`` at ``MockHub.url``).

* ``GET /api/models/{owner}/{name}[/revision/{rev}]`` -> model info JSON (``sha``, ``siblings``
  with ``size`` and ``blobId``)
* ``HEAD`` / ``GET /{owner}/{name}/resolve/{rev}/{path}`` -> the file, with ``ETag``,
  ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges``; ``Range: bytes=N-`` answers 206

Gated repositories answer 401 with ``X-Error-Code: GatedRepo`` unless the request carries
``Authorization: Bearer <token>`` with the repo's token; unknown ones 401 ``RepoNotFound`` (as the
hub does). ``requests`` records (method, path, Range) for the tests; ``fail_after`` cuts a GET's
body after that many bytes once, to test resuming.
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class Repo:
    def __init__(self, files: dict, token: str | None = None):
        self.files = {name: bytes(data) for name, data in files.items()}
        self.token = token                  # gated: this bearer token is needed
        self.sha = hashlib.sha1(b"".join(hashlib.sha256(d).digest() for d in self.files.values())).hexdigest()

    def etag(self, name: str) -> str:
        return hashlib.sha256(self.files[name]).hexdigest()


class MockHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list = []
        self.fail_after: dict[str, int] = {}   # file name -> bytes sent before the connection drops (once)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body=b"", headers=None):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

            def _error(self, status, code, message):
                self._send(status, json.dumps({"error": message}).encode(),
                           {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"})

            def _repo(self, repo_id):
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(401, "RepoNotFound", "Repository not found")
                    return None
                if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
                    return None
                return repo

            def do_GET(self):
                self._handle()

            def do_HEAD(self):
                self._handle()

            def _handle(self):
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = self._repo("/".join(parts[2:4]))
                    if repo is None:
                        return
                    info = {"id": "/".join(parts[2:4]), "modelId": "/".join(parts[2:4]), "sha": repo.sha,
                            "private": False, "gated": "manual" if repo.token else False,
                            "siblings": [{"rfilename": n, "size": len(d), "blobId": repo.etag(n)[:40]}
                                         for n, d in repo.files.items()]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = self._repo("/".join(parts[:2]))
                    if repo is None:
                        return
                    name = "/".join(parts[4:])
                    if name not in repo.files:
                        return self._error(404, "EntryNotFound", f"{name} does not exist")
                    data = repo.files[name]
                    start = 0
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes="):
                        start = int(rng[6:].split("-")[0])
                    headers = {"ETag": f'"{repo.etag(name)}"', "X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes",
                               "Content-Type": "application/octet-stream"}
                    body = data[start:]
                    headers["Content-Length"] = str(len(body))
                    if start:
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                    cut = hub.fail_after.pop(name, None) if self.command == "GET" else None
                    self.send_response(206 if start else 200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    if cut is not None:
                        self.wfile.write(body[:cut])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    self.wfile.write(body)
                    return
                self._error(404, "NotFound", f"no route {path}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: dict, token: str | None = None) -> Repo:
        self.repos[repo_id] = Repo(files, token)
        return self.repos[repo_id]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
