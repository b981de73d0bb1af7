import threading

import pytest
import uvloop


def pytest_asyncio_loop_factories(config, item):
    """Async tests run on uvloop, as ebrl.run_sync does."""
    return {"uvloop": uvloop.new_event_loop}


def ebrl_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ebrl-")]


@pytest.fixture
def no_leaks():
    """Fails a test that leaves an ebrl thread or a worker process behind."""
    import multiprocessing

    yield
    assert ebrl_threads() == []
    assert [p for p in multiprocessing.active_children() if p.name.startswith("ebrl-")] == []


@pytest.fixture
def hf_offline(monkeypatch):
    """No test may reach the network: connecting a socket raises, and the hub is told it is
    offline (the bring-your-own-VLA tests load every model from a local directory)."""
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
