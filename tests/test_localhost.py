"""trainer/localhost.py: the local services' health check, free port and liveness test, shared by the vLLM
service and the Prefect API."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import pytest

from trainer.localhost import free_port, health_url, healthy, pid_alive


@pytest.fixture
def server():
    """A local HTTP server: 200 at /health and /api/health, 503 at /down/health."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the base class's name)
            self.send_response(200 if self.path in ("/health", "/api/health") else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_health_url_is_vllms_at_its_root_and_prefects_under_its_api():
    assert health_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/health"
    assert health_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/health"
    assert health_url("http://127.0.0.1:4200/api") == "http://127.0.0.1:4200/api/health"
    assert health_url("http://127.0.0.1:4200/api/") == "http://127.0.0.1:4200/api/health"


def test_healthy_asks_the_health_check(server):
    assert healthy(server + "/v1")
    assert healthy(server + "/api")
    assert not healthy(server + "/down")  # answers, but not 200
    assert not healthy(f"http://127.0.0.1:{free_port()}/api", timeout=0.5)  # nothing listens


def test_pid_alive_is_false_for_a_zombie_and_a_gone_process():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert pid_alive(proc.pid)  # running, waiting for its input
    assert proc.stdin is not None
    proc.stdin.close()  # it exits; not reaped yet, it is a zombie, which is not alive
    deadline = time.monotonic() + 30
    while pid_alive(proc.pid):
        assert time.monotonic() < deadline, "the child never exited"
    assert proc.poll() == 0  # reaped now: gone
    assert not pid_alive(proc.pid)
    assert pid_alive(os.getpid())
