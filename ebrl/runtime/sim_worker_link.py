"""WorkerLink: the parent's handle on one worker process of
:class:`~ebrl.runtime.sim_workers.ProcessSimPool`: the process, its pipe, what is queued for it
and what it owes. The mechanism only (spawn, watch the pipe, send, read whole replies, retire,
stop); what a reply or a death means is the pool's. See :mod:`ebrl.runtime.sim_workers` for the
protocol and :mod:`ebrl.runtime.sim_worker_process` for the other end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import time
from collections import deque
from typing import Any

import numpy as np

from ebrl.runtime.children import child_context, portable
from ebrl.runtime.children import start as start_child
from ebrl.runtime.sim_types import EnvFn
from ebrl.runtime.threads import CLOSE_WAIT_S
from ebrl.runtime.sim_worker_process import PICKLED, QUIT, READ_BYTES, STEP, worker_main



class WorkerLink:
    """Worker ``index``: its process, the parent's end of its pipe, and its queues."""

    def __init__(self, index: int, process, conn, loop: asyncio.AbstractEventLoop | None):
        self.index, self.process, self.conn, self.loop = index, process, conn, loop
        self.steps: list[np.ndarray] = []  # ids whose actions are written, not yet sent
        self.requests: list[tuple[str, int, Any]] = []  # pickled requests, not yet sent
        self.waiting: deque[tuple[int, str, asyncio.Future]] = deque()  # sent requests, in order
        self.dead: str | None = None  # why it is gone
        self.killed = False  # killed for a hung step (its death is on the way)
        self.inbox = b""  # the start of a reply not yet whole (see read_replies)
        self.spawned_at = time.perf_counter()
        self.heard = False  # it has sent something (its READY first): it started (see ProcessSimPool.abandon)

    @classmethod
    def spawn(cls, start_method: str | None, loop: asyncio.AbstractEventLoop | None, index: int, env_fn: EnvFn,
              num_envs: int, reply_hold_s: float, attach: tuple) -> WorkerLink:
        """Start worker ``index`` (fork-safely: :func:`~ebrl.runtime.children.child_context`), hosting
        no env yet and mapping the shared memory named in ``attach`` at once."""
        ctx, _ = child_context(start_method)
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=worker_main, name=f"ebrl-sim-worker-{index}", daemon=True,
            args=(child, portable(env_fn, ctx), num_envs, reply_hold_s, attach))
        start_child(proc, ctx)
        child.close()
        return cls(index, proc, parent, loop)

    def watch(self, callback, *args) -> None:
        """Call ``callback(*args)`` on the loop whenever the pipe is readable."""
        fd = self.conn.fileno()
        self.loop.add_reader(fd, callback, *args)
        # add_reader makes the socket non-blocking; a message larger than the socket buffer
        # then arrives in pieces and recv_bytes would fail half-way. Readable means a message
        # has started, and the worker writes the rest at once: a blocking read is safe.
        os.set_blocking(fd, True)

    def unwatch(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.conn.fileno())

    def request(self, op: str, env_id: int, arg: Any) -> asyncio.Future:
        """Queue request ``op`` (sent, pickled, by the next :meth:`flush`); the future gets its reply."""
        if self.dead is not None:
            raise RuntimeError(f"env {env_id}: {self.dead}")
        fut = self.loop.create_future()
        self.requests.append((op, env_id, arg))
        self.waiting.append((env_id, op, fut))
        return fut

    def flush(self, sent_at: np.ndarray) -> bool:
        """Send the queued steps (one message; ``sent_at`` of their envs gets the send time) and
        requests (another). False if the pipe is broken: the worker died."""
        try:
            if self.steps:
                ids = np.concatenate(self.steps).astype(np.int32)
                self.steps = []
                sent_at[ids] = time.perf_counter()
                self.conn.send_bytes(STEP + ids.tobytes())
            if self.requests:
                reqs, self.requests = self.requests, []
                self.conn.send_bytes(PICKLED + pickle.dumps(reqs))
        except (BrokenPipeError, OSError):
            return False
        return True

    def read_replies(self) -> list[bytes] | None:
        """Every whole reply the worker has sent, or None if its end of the pipe closed (it died).
        One read takes what the pipe holds (often two replies at once); the framing is
        multiprocessing's (a 4-byte big-endian signed length, -1 for an 8-byte one), as the
        worker's ``send_bytes`` writes it. ``Connection.recv_bytes`` cost two reads and a BytesIO
        per reply. A reply not yet whole waits in ``inbox`` for the next read."""
        try:
            data = os.read(self.conn.fileno(), READ_BYTES)
        except OSError:
            data = b""
        if not data:
            return None
        self.heard = True
        if self.inbox:
            data, self.inbox = self.inbox + data, b""
        replies = []
        start, end = 0, len(data)
        while end - start >= 4:
            n, head = int.from_bytes(data[start:start + 4], "big", signed=True), 4
            if n == -1:  # over 2 GiB (a pickled request's reply, in theory)
                if end - start < 12:
                    break
                n, head = int.from_bytes(data[start + 4:start + 12], "big"), 12
            if end - start < head + n:
                break
            replies.append(data[start + head:start + head + n])
            start += head + n
        self.inbox = data[start:]
        return replies

    def kill(self) -> None:
        """SIGKILL it (a hung step or reset): its pipe closes, and the pool's reader sees it die."""
        self.killed = True
        self.process.kill()

    def mark_dead(self) -> None:
        """Its pipe closed: stop watching it, and say in ``dead`` how it ended."""
        self.unwatch()
        self.process.join(0.5)  # to learn its exit code; it closed its pipe, so it is exiting
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        self.dead = f"worker {self.index} died ({how})"

    def retire(self) -> None:
        """Stop watching it and tell it to quit (after what it was sent); its requests' futures
        are cancelled. :meth:`stop` joins it later."""
        self.unwatch()
        with contextlib.suppress(Exception):
            self.conn.send_bytes(QUIT)
        for _, _, fut in self.waiting:
            fut.cancel()
        self.waiting.clear()

    @staticmethod
    def stop(links: list[WorkerLink]) -> None:
        """Tell ``links``' workers to quit, then join them (``CLOSE_WAIT_S`` in all, then killed:
        a worker hung in a step never reads the message)."""
        for link in links:
            with contextlib.suppress(Exception):
                link.conn.send_bytes(QUIT)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for link in links:
            link.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if link.process.is_alive():
                link.process.kill()
                link.process.join()
            link.conn.close()
            for _, _, fut in link.waiting:
                fut.cancel()
