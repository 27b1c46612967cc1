"""The vLLM client's long requests against a stand-in HTTP server (only the client is under test; a real server runs
in test_vllm_backend.py): a generation is waited for as long as the server stays healthy, abandoned (never resent)
once its health check has failed for the request timeout, and sent exactly once either way."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_async.engines.vllm.client import VLLMServer, VLLMServerError


class StandIn:
    """``/health`` answers 200 while ``healthy`` is set, else 503; each ``POST /inference/v1/generate`` is counted
    and answered (one completion of two tokens) once ``reply`` is set."""

    def __init__(self) -> None:
        self.healthy, self.reply = threading.Event(), threading.Event()
        self.healthy.set()
        self.posts = 0
        self.status = 200  # another: answered at once with it (a 5xx is a request the server is not running)
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200 if stand_in.healthy.is_set() else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                stand_in.posts += 1
                if stand_in.status != 200:
                    self.send_response(stand_in.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if not stand_in.reply.wait(30):
                    return
                logprobs = {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}
                spans = [{"version": "3", "start": 0, "end": 2}]  # the weights' label as the server echoes it
                choice = {"index": 0, "token_ids": [7, 8], "logprobs": logprobs, "weight_versions": spans}
                body = json.dumps({"choices": [choice]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.reply.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in():
    server = StandIn()
    yield server
    server.close()


def test_a_generation_longer_than_the_request_timeout_returns_through_generate_sent_once(stand_in):
    threading.Timer(2.5, stand_in.reply.set).start()  # past one health check (every 2 s) and the 0.5 s timeout
    client = VLLMServer(stand_in.url, request_timeout_s=0.5, retry_s=30)
    start = time.monotonic()
    completions = client.generate([5, 6], {"n": 1, "max_tokens": 2, "logprobs": 0})
    assert time.monotonic() - start > 2.0  # it outlived the timeout, else this shows nothing
    assert [(c.token_ids, c.logprobs, c.versions) for c in completions] == [((7, 8), (-0.5, -0.25), (3, 3))]
    assert stand_in.posts == 1


def test_a_generation_on_a_server_that_fails_its_health_check_is_abandoned_not_resent(stand_in):
    threading.Timer(0.5, stand_in.healthy.clear).start()  # it stops being healthy while running the request
    client = VLLMServer(stand_in.url, request_timeout_s=1.0, retry_s=30)
    with pytest.raises(VLLMServerError, match=r"failed its health check .* abandoned, not resent"):
        client.generate([5, 6], {"n": 1, "max_tokens": 2, "logprobs": 0})
    time.sleep(0.5)  # a resend would have reached the stand-in by now
    assert stand_in.posts == 1


def test_a_lane_that_reports_its_server_down_abandons_the_request_at_the_next_check(stand_in):
    alive = threading.Event()
    alive.set()
    threading.Timer(0.5, alive.clear).start()  # the lane's own health thread gave up on the server
    client = VLLMServer(stand_in.url, request_timeout_s=60.0, retry_s=30)  # the lane's verdict, not this, decides
    with pytest.raises(VLLMServerError, match="abandoned, not resent"):
        client.generate([5, 6], {"n": 1, "max_tokens": 2, "logprobs": 0}, alive=alive.is_set)
    assert stand_in.posts == 1


def test_a_lane_stopped_while_a_failed_request_waits_to_be_resent_sends_it_no_more(stand_in):
    """A 5xx is resent after a backoff; a lane stopped during that backoff sends nothing after it (its server may by
    then be another one behind the same URL, or its adapter's files gone)."""
    stand_in.status = 503
    stopped = threading.Event()
    threading.Timer(0.1, stopped.set).start()  # during the first backoff (0.25 s)
    client = VLLMServer(stand_in.url, request_timeout_s=5, retry_s=30)
    with pytest.raises(VLLMServerError, match="abandoned, its lane was stopped"):
        client.generate([5, 6], {"n": 1, "max_tokens": 2, "logprobs": 0}, stopped=stopped.is_set)
    time.sleep(1.0)
    assert stand_in.posts == 1


@pytest.mark.unit
def test_a_re_attached_lane_counts_its_silence_from_the_re_attach_not_from_its_last_check_before_the_push(
    stand_in, monkeypatch
):
    """A server's health checks can go unanswered while it is being re-attached (the transport opened, the weights
    pushed), which takes seconds for a large model. The re-attach is itself the server answering: the lane must not be
    found silent the moment it is attached."""
    from trl_async.engines.vllm import server_lane
    from trl_async.engines.vllm.weight_push.recovery import Return

    monkeypatch.setattr(server_lane, "HEALTH_INTERVAL_S", 3600.0)  # no health check runs here: the clock is set below
    spec = server_lane.VLLMLaneSpec(0, stand_in.url, {"n": 1}, (0,), 0, 1, 30.0, 1.0)
    back = Return(stand_in.url, {}, None, 10, lambda: False, state="back", back_at=time.time())
    lane = server_lane.VLLMLane(spec, capacity=1, returning=back)
    try:
        now = time.time()
        lane._last_healthy = now - 5.0  # its last answered check came before the push began
        assert lane.silent_for(now) == 0.0  # while returning, its Return watches the limits
        back.attach(now)
        assert lane.silent_for(now + 0.5) == pytest.approx(0.5)
        assert lane.silent_for(now + 4.0) == pytest.approx(4.0)  # silence counts on from the re-attach
        lane._last_healthy = now + 3.0  # a later answered check moves the clock on as before
        assert lane.silent_for(now + 4.0) == pytest.approx(1.0)
    finally:
        lane.kill()
