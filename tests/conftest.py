import faulthandler
import sys
import threading

import pytest
import uvloop


@pytest.fixture(autouse=True)
def _stacks_before_timeout(request):
    """Every thread's stack on stderr a second before pytest-timeout ends a hung test. Its own
    dump goes to the terminal, which an xdist worker does not show; faulthandler writes from C,
    so it fires while the main thread sits in uvloop's loop."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if limit > 1:
        faulthandler.dump_traceback_later(limit - 1, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


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

    connect = socket.socket.connect

    def refuse(sock, *args, **kwargs):
        if sock.family == socket.AF_UNIX:  # this machine's own (a fork server's socket)
            return connect(sock, *args, **kwargs)
        raise OSError("network access attempted in an offline test")

    def refuse_connection(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse_connection)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama at save_random_hf_model's defaults (hidden 32, 2 layers, initializer
    range 0.02, as a fresh config gives), with the words "reach the target"."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from ebrl.testing import save_random_hf_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_hf_model(path, kind="llama", sentences=("reach the target",))
    return path
