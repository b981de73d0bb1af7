"""The learner's unit of work (:func:`update_once`), and the child process that runs it on a
CPU host (:class:`LearnerProcess`), where a learner thread and the event loop would convoy on the
GIL (each small torch op releases it and waits to get it back): the learner's stage thread sends
the process a batch and waits in the pipe without the GIL (measured: the README's design section).
"""

from __future__ import annotations

import time

import torch

from ebrl.algos.batch import Batch
from ebrl.checkpoint import algo_state
from ebrl.policies.base import load_published, published_state, state_nbytes
from ebrl.runtime.children import Child, ChildDied, ChildFailed, child_context, serve
from ebrl.runtime.errors import LearnerError
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


class _Learner:
    """The learner process's side: the training copies, and the requests the parent sends."""

    def __init__(self, policy, algo, torch_threads: int | None):
        self.policy, self.algo = policy, algo
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)

    def update(self, batch: Batch, threads: int | None):
        if threads is not None:  # the resource controller's thread count
            torch.set_num_threads(threads)
        return update_once(self.policy, self.algo, batch)

    def algo_state(self) -> dict | None:  # for a checkpoint
        return algo_state(self.algo)

    def restore(self, state: dict) -> None:  # a skipped update (NaN/inf): back to the last published weights
        restore(self.policy, self.algo, state)

    def final(self) -> tuple[dict, dict | None]:
        """The trained state, handed back at close: what a publication carries (of a policy with a
        frozen part, DSRL's flow policy or a LoRA-tuned backbone, the part that trains) and the
        algorithm's state."""
        return published_state(self.policy), algo_state(self.algo)


def _learner_main(conn, policy, algo, torch_threads: int | None) -> None:
    serve(conn, _Learner(policy, algo, torch_threads))  # READY once built: the parent times the start-up until here


class LearnerProcess:
    """The policy's and algorithm's training copies in a child process (:class:`~ebrl.runtime.children.Child`).
    Its start-up has ``start_timeout_s``, each update ``update_timeout_s`` (None: none); past
    either, the process is killed and the call fails with a :class:`LearnerError`. Every call
    blocks: the learner's thread waits in the pipe without the GIL."""

    def __init__(self, policy, algo, torch_threads: int | None, start_method: str | None = None,
                 start_timeout_s: float | None = None, update_timeout_s: float | None = None):
        self.update_timeout_s = update_timeout_s
        self.child = Child.start("ebrl-learner-process", _learner_main, policy, algo, torch_threads,
                                 ctx=child_context(start_method)[0], start_timeout_s=start_timeout_s)

    def update(self, batch: Batch, threads: int | None = None):
        """``threads``: torch's intra-op threads in the learner process from this update on."""
        return self._ask("update", batch, threads, timeout_s=self.update_timeout_s)

    def restore(self, state: dict) -> None:
        """:func:`restore` in the learner process."""
        self._ask("restore", state)

    def algo_state(self) -> dict | None:
        """The algorithm's state, for a checkpoint."""
        return self._ask("algo_state")

    def kill(self) -> None:
        """SIGKILL it: a call waiting on it ends with a :class:`LearnerError`."""
        self.child.kill()

    def _ask(self, op: str, *args, timeout_s: float | None = None):
        try:
            return self.child.ask_blocking(op, *args, timeout_s=timeout_s)
        except TimeoutError:
            what, limit, setting = ((op, timeout_s, "update_timeout_s") if self.child.heard
                                    else ("start-up", self.child.start_timeout_s, "build_timeout_s"))
            raise LearnerError(f"the learner process's {what} ran past faults.{setting}={limit:g} s; "
                               "the process was killed") from None
        except ChildDied as exc:
            raise LearnerError(f"the learner process died ({exc.how})") from None
        except ChildFailed as exc:
            what = "algo.update" if op == "update" else op
            raise LearnerError(f"{what} failed in the learner process:\n{exc.trace}") from None

    def close(self, policy, algo) -> None:
        """Load the trained state into the caller's ``policy`` and ``algo``; end the process
        (waiting ``ANSWER_WAIT_S`` at most for its answer: a hung or dead learner is killed). One
        never asked anything trained nothing: it is killed at once, started up or not."""
        try:
            if self.child.heard:
                policy_state, algo_state = self.child.ask_blocking("final", timeout_s=ANSWER_WAIT_S)
                load_published(policy, policy_state)
                if algo_state is not None:
                    algo.load_state_dict(algo_state)
        except TimeoutError:
            log.warning("learner_process_unanswered", wait_s=ANSWER_WAIT_S)
        except (ChildDied, ChildFailed, OSError) as exc:
            log.warning("learner_process_lost", error=str(exc))  # the run's own error says more
        finally:
            self.child.reap(5.0 if self.child.heard else 0.0)
