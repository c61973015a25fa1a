"""A small OpenAI-compatible server for the loop's local policy (CPU, transformers): what TCPO's
counterfactual stage needs from a server when the loop collects with the `local` backend and no vLLM runs.

    srv = PolicyServer().start()          # a free local port, a background thread
    url = srv.url                         # http://127.0.0.1:<port>/v1 -> config llm.endpoints
    ...                                   # config llm.model = the loop's workdir (or a checkpoint folder)
    srv.stop()

The request's `model` names what to serve: a checkpoint folder (config.json inside), or a loop workdir, in
which case the newest complete `ckpt-round<r>` is served, else its `base-tiny` (while round r is processed that
is P_r, the policy that collected round r: the counterfactual alternatives come from the rollout policy, as
TCPO requires). Models are loaded once per folder and kept (a few, least recently used dropped).

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions (messages, n, temperature, top_p,
max_tokens, seed, logprobs). The prompt is the messages' contents tokenized one by one and concatenated: the
collect stage's text layout (no chat template), so an alternative is sampled from exactly the context the
rollout saw. Sampling is trainer.generation.LocalGenerator (the same sampler as the local collect backend).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def resolve_model(name: str, fallback: Path | None = None) -> Path:
    """The folder to serve for a request's `model`: a checkpoint folder, or a loop workdir's newest policy
    (its base model before the first checkpoint: `base-tiny`, else `fallback`)."""
    p = Path(name).expanduser()
    if (p / "config.json").exists():
        return p
    ckpts = []
    for c in p.glob("ckpt-round*"):
        suffix = c.name.removeprefix("ckpt-round")
        if suffix.isdigit() and (c / "config.json").exists() and any(c.glob("*.safetensors")):
            ckpts.append((int(suffix), c))
    if ckpts:
        return max(ckpts)[1]
    if (p / "base-tiny" / "config.json").exists():
        return p / "base-tiny"
    if fallback is not None and (Path(fallback) / "config.json").exists():
        return Path(fallback)
    raise FileNotFoundError(f"{name}: no checkpoint folder, loop checkpoint or base-tiny model")


class PolicyServer:
    """The HTTP server and its model cache; `start()` runs it in a daemon thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_models: int = 4,
        base: str | Path | None = None,
        device: str = "auto",
    ):
        self.host, self.port, self.max_models = host, port, max_models
        self.base = Path(base) if base is not None else None
        self.device = device
        self._models: OrderedDict[tuple[str, float], object] = OrderedDict()
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def generator(self, folder: Path):
        from trainer.generation import Codec, LocalGenerator

        key = (str(folder), (folder / "config.json").stat().st_mtime)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        gen = LocalGenerator(folder, Codec(folder), device=self.device, threads=1)
        self._models[key] = gen
        while len(self._models) > self.max_models:
            self._models.popitem(last=False)
        return gen

    def chat(self, body: dict) -> dict:
        folder = resolve_model(str(body.get("model") or ""), self.base)
        n = int(body.get("n") or 1)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
        top_p = float(body.get("top_p", 1.0) if body.get("top_p") is not None else 1.0)
        seed = int(body.get("seed") or 0)
        with self._lock:  # one generation at a time: the models are small, torch threads are not shared
            gen = self.generator(folder)
            context: list[int] = []
            for m in body.get("messages") or []:
                content = m.get("content") or ""
                if isinstance(content, list):
                    content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
                context += gen.codec.encode(content)[0]
            outs = gen.generate([context] * n, [max_tokens] * n, temperature, top_p, seed)
        self.requests += 1
        choices = []
        for i, g in enumerate(outs):
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": g.text},
                "finish_reason": g.finish or "stop",
            }
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": gen.codec.decode([t]),
                            "logprob": float(lp),
                            "bytes": None,
                            "top_logprobs": [],
                        }
                        for t, lp in zip(g.token_ids, g.logprobs or [], strict=False)
                    ]
                }
            choices.append(choice)
        completion = sum(len(g.token_ids) for g in outs)
        return {
            "id": f"chatcmpl-policy-{self.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or folder),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(context),
                "completion_tokens": completion,
                "total_tokens": len(context) + completion,
            },
        }

    def start(self) -> PolicyServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                return

            def _send(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.rstrip("/") in ("/health", "/v1/health"):
                    self._send(200, {"status": "ok"})
                elif self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                    self._send(200, server.chat(body))
                except FileNotFoundError as exc:
                    self._send(404, {"error": {"message": str(exc), "type": "not_found"}})
                except (ValueError, TypeError, KeyError) as exc:
                    self._send(400, {"error": {"message": str(exc), "type": "bad_request"}})

        self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, name="policy-server", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
