"""When the adapter files of a run may go (engines/vllm/adapters.py, ``ServedAdapters.close``), against a stand-in
HTTP server (only the cleanup is under test; test_vllm_lora.py runs it against a real server). vLLM loads a LoRA
adapter from its files when a request that names it is scheduled, and its engine dies if they are gone
(FileNotFoundError, seen in a fresh-clone CI run): so the files go only once the server runs none of our requests,
as its gauges say after it has stepped, and once no request thread of ours can still send one."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_async.engines.vllm.adapters import ServedAdapters
from trl_async.engines.vllm.client import VLLMServer


class SteppingServer:
    """A server whose ``/metrics`` gauges, like vLLM's, change only when its engine steps (here: when it answers a
    generate request). ``running`` requests of ours are in its engine; each step finishes one of them
    (``finish_per_step``). Every request is logged in ``events`` with what the engine really ran at that moment."""

    def __init__(self, running: int, finish_per_step: int = 1) -> None:
        self.running, self.finish_per_step = running, finish_per_step
        self.gauge = 0  # stale: the engine has not stepped since our requests arrived
        self.refuse = False
        self.events: list[tuple[str, int]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, body: dict | str) -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                stand_in.events.append((self.path, stand_in.running))
                if self.path == "/metrics":
                    self._answer(f"vllm:num_requests_running{{engine=\"0\"}} {stand_in.gauge}.0\n"
                                 "vllm:num_requests_waiting{engine=\"0\"} 0.0\n")  # fmt: skip
                else:
                    self._answer({})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                stand_in.events.append((self.path, stand_in.running))
                if self.path == "/inference/v1/generate" and stand_in.refuse:
                    self.send_response(503)  # paused, say: it answers /health, takes no request, runs what it has
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/inference/v1/generate":  # a step: the gauges catch up, and one request ends
                    stand_in.gauge = stand_in.running
                    stand_in.running = max(0, stand_in.running - stand_in.finish_per_step)
                    choice = {"index": 0, "token_ids": [7], "logprobs": {"content": [{"logprob": -0.5}]}}
                    self._answer({"choices": [choice]})
                else:
                    self._answer({})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def unloads(self) -> list[int]:
        """What the engine ran when each unload arrived."""
        return [running for path, running in self.events if path == "/v1/unload_lora_adapter"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served(tmp_path):
    made = []

    def make(running: int) -> tuple[SteppingServer, ServedAdapters]:
        server = SteppingServer(running)
        made.append(server)
        adapters = ServedAdapters(
            [VLLMServer(server.url, request_timeout_s=5, retry_s=5)], keep=2, directory=str(tmp_path)
        )
        for version in (3, 4):  # two versions loaded, with their files
            (adapters.directory / f"v{version}").mkdir(parents=True)
        adapters.resident, adapters.current = [3, 4], 4
        return server, adapters

    yield make
    for server in made:
        server.close()


def test_files_stay_while_the_server_still_runs_a_request_its_stale_gauges_do_not_show_yet(served):
    """The gauges read 0 before the engine has stepped with our last two requests: the cleanup makes it step, and
    unloads and deletes only once the gauges, read after a step, show nothing running."""
    server, adapters = served(running=2)
    adapters.close(drain_s=20)
    assert server.unloads() == [0, 0]  # both versions unloaded, each when the engine ran nothing
    assert not adapters.directory.exists()
    assert server.running == 0


def test_files_stay_while_a_request_thread_holds_an_adapter_and_none_is_handed_out_after_close(served):
    """A lane's request thread that holds a version when training ends may still send its request: the cleanup
    waits for it to let go (each lane stops its threads at once), and hands out no adapter once it has begun."""
    server, adapters = served(running=0)
    name, version = adapters.acquire(timeout_s=1)
    assert (name, version) == (adapters.name(4), 4)
    closing = threading.Thread(target=adapters.close, kwargs={"drain_s": 20})
    closing.start()
    time.sleep(1.5)
    assert closing.is_alive() and server.unloads() == [] and (adapters.directory / "v4").exists()
    with pytest.raises(RuntimeError, match="closed"):
        adapters.acquire(timeout_s=1)
    adapters.release(version)
    closing.join(20)
    assert not closing.is_alive()
    assert len(server.unloads()) == 2 and not adapters.directory.exists()


def test_a_request_thread_that_never_lets_go_delays_the_cleanup_at_most_drain_s_and_the_files_are_kept(served, caplog):
    server, adapters = served(running=0)
    adapters.acquire(timeout_s=1)
    start = time.monotonic()
    adapters.close(drain_s=1.0)
    assert time.monotonic() - start < 10
    assert (adapters.directory / "v4").exists()  # kept for the request that may still run on it
    assert "left in" in caplog.text


def test_a_server_that_answers_health_but_refuses_the_step_request_is_not_taken_as_drained(served, caplog):
    """Only a server that is gone counts as running nothing without a read of its gauges: one that answers /health
    but refuses the request that would make it step (paused, overloaded) keeps the files until drain_s."""
    server, adapters = served(running=1)
    server.refuse = True
    adapters.close(drain_s=2.0)
    assert (adapters.directory / "v4").exists() and "still run requests" in caplog.text
