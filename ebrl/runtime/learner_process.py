"""The learner's unit of work (:func:`update_once`), and the child process that runs it on a
CPU host (:class:`LearnerProcess`).

On a CPU host a learner thread and the event loop convoy on the GIL: every small torch op,
BLAS call or pipe write releases it and waits for the other thread's next op to get it back.
The process holds the policy's and algorithm's training copies; the learner's stage thread
sends it a batch and waits in the pipe without the GIL. Measured on 2 cores with HalfCheetah
and PPO: see the README's design section.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import time
from typing import NoReturn
import traceback

import torch

from ebrl.algos.batch import Batch
from ebrl.checkpoint import algo_state
from ebrl.policies.base import load_published, published_state, state_nbytes
from ebrl.runtime.children import child_context, helpers_scope, portable
from ebrl.runtime.children import start as start_child
from ebrl.runtime.errors import LearnerError
from ebrl.runtime.threads import ignore_stop_signals
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.learner")
ANSWER_WAIT_S = 2.0  # how long close() waits for the process's trained state (a child still warming up takes ~1 s)


def snapshot(state: dict) -> dict:
    """A detached copy of a state dict (tensors cloned, other values as they are)."""
    return {k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in state.items()}


def update_once(policy, algo, batch: Batch, clock=None):
    """Update, snapshot what publication carries (the trainable tensors of a policy with a frozen
    part, else the state_dict): the learner's unit of work, wherever it runs. The metrics gain
    the publication's size and the snapshot's seconds (on ``clock``, default ``perf_counter``)."""
    clock = clock or time.perf_counter
    lags = batch.lags.numpy()
    metrics = {k: float(v) for k, v in (algo.update(policy, batch) or {}).items()}
    t0 = clock()
    state = snapshot(published_state(policy))
    metrics["publish_s"] = clock() - t0
    metrics["publish_bytes"] = float(state_nbytes(state))
    return metrics, state, lags


def nonfinite_weights(state: dict) -> list[str]:
    """The names of a state dict's floating-point tensors holding NaN or inf."""
    return [k for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def restore(policy, algo, state: dict) -> None:
    """Undo an update: the weights as published last, and a fresh optimiser (its moments may
    hold the NaN) where the algorithm can reset one."""
    load_published(policy, state)
    reset = getattr(algo, "reset_optimizer", None)
    if callable(reset):
        reset()


def _send(conn, msg) -> None:
    # plain pickle copies tensors by value; Connection.send would route them through
    # torch's shared-memory handles, which need the sender alive to be opened
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _learner_main(conn, policy, algo, torch_threads: int | None) -> None:
    ignore_stop_signals()  # the parent decides when we stop
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        _send(conn, ("ready",))  # the parent times the start-up until here
        while True:
            msg = _recv(conn)
            if msg[0] == "update":
                if len(msg) > 2 and msg[2] is not None:  # the resource controller's thread count
                    torch.set_num_threads(msg[2])
                try:
                    metrics, state, lags = update_once(policy, algo, msg[1])
                    _send(conn, ("ok", metrics, state, lags))
                except Exception as exc:
                    _send(conn, ("error", "".join(traceback.format_exception(exc))))
            elif msg[0] == "algo_state":  # for a checkpoint
                _send(conn, ("algo_state", algo_state(algo)))
            elif msg[0] == "restore":  # a skipped update (NaN/inf): back to the last published weights
                restore(policy, algo, msg[1])
                _send(conn, ("restored",))
            else:  # "close": hand the trained state back
                _send(conn, ("final", policy.state_dict(), algo_state(algo)))
                return
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass


class LearnerProcess:
    """The policy's and algorithm's training copies, in a child process started fork-safely
    (:func:`~ebrl.runtime.children.child_context`). Its start-up (until it says it is ready) has
    ``start_timeout_s``; each update has ``update_timeout_s`` (``faults.update_timeout_s``, None:
    none). Past either, the process is killed and the update fails with a :class:`LearnerError`."""

    def __init__(self, policy, algo, torch_threads: int | None, start_method: str | None = None,
                 start_timeout_s: float | None = None, update_timeout_s: float | None = None):
        ctx, _ = child_context(start_method)
        self._helpers = contextlib.ExitStack()  # a fork server it needs ends with it
        self._helpers.enter_context(helpers_scope())
        self.start_timeout_s, self.update_timeout_s = start_timeout_s, update_timeout_s
        self.ready = False
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_learner_main, name="ebrl-learner-process", daemon=True,
                                   args=(child, portable(policy, ctx), portable(algo, ctx), torch_threads))
        start_child(self.process, ctx)
        child.close()

    def update(self, batch: Batch, threads: int | None = None):
        """Blocking: called from the learner's thread, which waits in the pipe without the GIL.
        ``threads``: torch's intra-op threads in the learner process from this update on."""
        self._ask(("update", batch, threads))
        self._wait("update", self.update_timeout_s, "update_timeout_s")
        msg = self._recv()
        if msg[0] == "error":
            raise LearnerError("algo.update failed in the learner process:\n" + msg[1])
        _, metrics, state, lags = msg
        return metrics, state, lags

    def _start_up(self) -> None:
        """Wait for the process's start-up message (once), under ``start_timeout_s``."""
        if not self.ready:
            self._wait("start-up", self.start_timeout_s, "build_timeout_s")
            self._recv()  # ("ready",)
            self.ready = True

    def _wait(self, what: str, timeout_s: float | None, setting: str) -> None:
        """Wait ``timeout_s`` at most for the process's answer; past it, kill it and raise."""
        if timeout_s is not None and not self.conn.poll(timeout_s):
            self.process.kill()
            raise LearnerError(f"the learner process's {what} ran past faults.{setting}={timeout_s:g} s; "
                               "the process was killed")

    def restore(self, state: dict) -> None:
        """Blocking, like :meth:`update`: :func:`restore` in the learner process."""
        self._ask(("restore", state))
        self._recv()

    def algo_state(self) -> dict | None:
        """Blocking, like :meth:`update`: the algorithm's state, for a checkpoint."""
        self._ask(("algo_state",))
        return self._recv()[1]

    def _ask(self, msg) -> None:
        """Send ``msg`` once the process has started; a dead process raises :class:`LearnerError`."""
        self._start_up()
        try:
            _send(self.conn, msg)
        except OSError:  # a broken pipe: it died
            self._died()

    def _recv(self):
        try:
            return _recv(self.conn)
        except (EOFError, OSError):
            self._died()

    def _died(self) -> NoReturn:
        self.process.join(1.0)
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        raise LearnerError(f"the learner process died ({how})") from None

    def close(self, policy, algo) -> None:
        """Load the trained state into the caller's ``policy`` and ``algo``; end the process
        (waiting ``ANSWER_WAIT_S`` at most for its answer: a hung or dead learner is killed). One
        never asked anything trained nothing: it is killed at once, started up or not."""
        try:
            if self.process.is_alive() and self.ready:
                _send(self.conn, ("close",))
                if not self.conn.poll(ANSWER_WAIT_S):
                    log.warning("learner_process_unanswered", wait_s=ANSWER_WAIT_S)
                    return
                _, policy_state, algo_state = self._recv()
                policy.load_state_dict(policy_state)
                if algo_state is not None:
                    algo.load_state_dict(algo_state)
        except (LearnerError, BrokenPipeError, OSError) as exc:
            log.warning("learner_process_lost", error=str(exc))  # the run's own error says more
        finally:
            self.process.join(timeout=5.0 if self.ready else 0.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.conn.close()
            self._helpers.close()
