"""A server on 127.0.0.1 (free port) over the tiny llama pair, started once per module."""

import threading
import time
from dataclasses import dataclass

import pytest

from smcspec import LLM
from smcspec.server.app import HTTPServer, ServeDefaults, create_app

MODEL = "tiny"


@dataclass
class Served:
    url: str
    llm: LLM
    server: object  # smcspec.server.app.Server

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.v1, api_key="unused", max_retries=0, timeout=60, **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request runs or waits (cancellations land asynchronously)."""
        end = time.monotonic() + timeout
        s = self.server.scheduler
        while (s.running or s.queued) and time.monotonic() < end:
            time.sleep(0.02)


def serve(llm: LLM, defaults: ServeDefaults):
    app = create_app(llm, defaults)
    server = HTTPServer(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > end or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Served(f"http://127.0.0.1:{port}", llm, app.state.server), server, thread


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_folder, tiny_llama_draft_folder):
    target, draft = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    return LLM(target, draft, backend="native", dtype="float32")


@pytest.fixture(scope="module")
def served(tiny_llm):
    defaults = ServeDefaults(MODEL, particles=4, draft_tokens=3, max_tokens=16)
    handle, server, thread = serve(tiny_llm, defaults)
    yield handle
    server.should_exit = True
    thread.join(timeout=30)
