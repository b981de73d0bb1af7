"""Scale-out: one full EBRL runtime per process (a *rank*), learners kept identical by
all-reducing gradients over ``torch.distributed`` (gloo on the CPU, NCCL on GPUs).

Launch a job with any of::

    ebrl train --nproc 2 --set env=mujoco/HalfCheetah-v5          # ebrl starts torchrun's agent
    torchrun --nproc-per-node 2 -m ebrl train --set env=...       # torchrun itself
    ebrl launch --ray auto --nproc 8 --set env=...                # one rank per GPU (or CPU slot) on Ray

and in a script started by ``torchrun``, ``await ebrl.run(trainer)`` joins the job from
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); nothing
else changes. Each rank runs its own envs, sim pool, generator and resource controller, with
a seed of its own (:func:`rank_seed`) and ``total_env_steps / world_size`` env steps (the budget is the
job's). Rank 0 writes the log directory (history, TensorBoard, checkpoints, ``result.json``).

**Updates.** Rollout stays asynchronous per rank; only updates are joint. A rank whose queue
falls due asks for the next update (a key in the job's store) and every rank then joins it
with what it has collected, so a rank with slow envs brings fewer samples instead of making
the others wait for its steps. Within an update every rank runs the same number of minibatch
steps (the most any rank needs at ``minibatch_size`` rows per rank), and each step's gradient
is the rows-weighted mean of the ranks' gradients, ``sum_r n_r g_r / sum_r n_r``: the gradient
of the mean loss over every rank's rows, as if one learner held them all. Observation and
reward statistics merge the same way, so every rank holds the same weights after every
update; the runtime checks that after each one (a hash of the weights in the next update's
header) and fails the job on a mismatch.

**Faults.** A rank that dies ends the job as soon as its sockets close; collectives time out
after ``timeout_s`` (``faults.collective_timeout_s``, 120 s, above the step timeout): a rank that hangs ends
the job with one error naming what was lost, and every rank's children exit with it.

    >>> from ebrl.distributed import DataParallel
    >>> DataParallel.from_env({}) is None          # not under torchrun: one process
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

DEFAULT_TIMEOUT_S = 120.0  # RunConfig.faults.collective_timeout_s's default
_joins = 0  # runs joined by this process

# set in the learner's thread during a data-parallel update: merge_moments and the reward
# statistics all-reduce their batch sums through it
_active: contextvars.ContextVar[DataParallel | None] = contextvars.ContextVar("ebrl_data_parallel", default=None)


class RankLostError(RuntimeError):
    """A collective failed: another rank died, hung past the timeout, or left the job."""


class RanksDivergedError(RuntimeError):
    """The ranks' weights differ after an update (they must be identical)."""


def in_job(environ: dict | None = None) -> bool:
    """Whether this process is one rank of a job of two or more (torchrun's environment), and
    ``EBRL_DATA_PARALLEL=0`` does not keep its runs single-process (a script that calls
    ``ebrl.run`` on one rank of someone else's job)."""
    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE", "1")) > 1 and env.get("EBRL_DATA_PARALLEL", "1") != "0"


_stores: dict[tuple, Any] = {}


def job_store(environ: dict | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
    """The job's key-value store (``torch.distributed.TCPStore`` at ``MASTER_ADDR:MASTER_PORT``),
    one connection per process. Under torchrun's agent the agent hosts it; else rank 0 does."""
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"])
    key = (host, port)
    if key not in _stores:
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        _stores[key] = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent,
                                     timeout=timedelta(seconds=timeout_s))
    return _stores[key]


def release_stores() -> None:
    """Drop this process's store connections (before exit, not during interpreter teardown)."""
    _stores.clear()


def share(key: str, make, environ: dict | None = None) -> str:
    """A string rank 0 makes (``make()``) and every rank of the job gets, e.g. the run's log
    directory; the value itself outside a job."""
    env = os.environ if environ is None else environ
    if not in_job(env):
        return make()
    store = job_store(env)
    name = f"ebrl/share/{env.get('TORCHELASTIC_RUN_ID', '')}/{key}"
    if int(env["RANK"]) == 0:
        store.set(name, make())
    return store.get(name).decode()


def rank_share(total: int, rank: int, world_size: int) -> int:
    """Rank ``rank``'s part of a job's ``total`` env steps (the first ranks take the remainder).

        >>> [rank_share(10, r, 3) for r in range(3)]
        [4, 3, 3]
    """
    return total // world_size + (1 if rank < total % world_size else 0)


def weight_hash(module: torch.nn.Module) -> str:
    """SHA-256 of a module's state dict (names, dtypes, shapes and bytes), in name order."""
    h = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _checksum(state: dict) -> int:
    """A cheap 24-bit checksum of a state dict's tensors (exact in a float64 all-reduce)."""
    c = 0
    for name in sorted(state):
        v = state[name]
        if isinstance(v, torch.Tensor) and v.numel():
            c = zlib.crc32(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), c)
    return c & 0xFFFFFF


@dataclass
class DataParallel:
    """This rank's handle on the job: rank, size, the store, the collectives an update needs."""

    rank: int
    world_size: int
    store: Any  # torch.distributed.Store for update requests
    device: torch.device  # where collectives' tensors live: CPU for gloo, the GPU for NCCL
    timeout_s: float = DEFAULT_TIMEOUT_S
    owns_group: bool = False  # we initialised the process group, so we destroy it
    checks: int = field(default=0)  # weight checks passed

    # ---------------------------------------------------------------- joining and leaving

    @classmethod
    def from_env(cls, environ: dict | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: torch.device | None = None) -> DataParallel | None:
        """Join the job torchrun (or ``ebrl launch``) described in the environment; None when
        the world is one process. Uses a process group the script made already, if any.
        ``device``: the policy's; NCCL on a CUDA one (``EBRL_BACKEND=gloo`` keeps gloo), gloo
        otherwise."""
        env = os.environ if environ is None else environ
        if not in_job(env):
            return None
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        timeout = timedelta(seconds=timeout_s)
        global _joins
        _joins += 1  # each run() of a script is a new group: its keys never meet an earlier run's
        # ... nor an earlier attempt's, when torchrun restarts the job in its store
        tag = f"ebrl/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_joins}"
        owns = not dist.is_initialized()
        if owns:
            store = job_store(env, timeout_s)
            cuda = device is not None and device.type == "cuda"
            backend = "nccl" if cuda and env.get("EBRL_BACKEND", "") != "gloo" else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(device)
            dist.init_process_group(backend, store=dist.PrefixStore(f"{tag}/pg", store), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            store = dist.distributed_c10d._get_default_store()  # the script's: one store per job
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        # (NCCL's collectives are asynchronous: a hang ends in its watchdog's abort, not RankLostError)
        return cls(rank, world, dist.PrefixStore(f"{tag}/updates", store), device, timeout_s, owns)

    def close(self, clean: bool = True) -> None:
        """Leave the job: after a barrier when ``clean`` (no rank tears its group down while
        another still talks to it; none after a fault, which would wait out the timeout again),
        the process group is destroyed while the interpreter is whole (gloo's threads
        outliving it abort the process at exit)."""
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            if clean:
                try:
                    dist.barrier()
                except RuntimeError:
                    pass  # another rank is gone already: nothing to wait for
            dist.destroy_process_group()
        release_stores()

    # ---------------------------------------------------------------- collectives

    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ConnectionError) as exc:  # gloo's and NCCL's errors are RuntimeErrors
            raise RankLostError(f"rank {self.rank} of {self.world_size}: {what} failed, so another rank died, hung "
                                f"for over {self.timeout_s:g} s or left the job ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None

    def _all_reduce(self, x: torch.Tensor, op: str, what: str) -> torch.Tensor:
        import torch.distributed as dist

        t = x.to(self.device)
        self._collective(what, dist.all_reduce, t, op=getattr(dist.ReduceOp, op))
        return t.to(x.device)

    def all_sum(self, x: torch.Tensor, what: str = "an all-reduce") -> torch.Tensor:
        return self._all_reduce(x, "SUM", what)

    def all_max(self, x: torch.Tensor, what: str = "an all-reduce") -> torch.Tensor:
        return self._all_reduce(x, "MAX", what)

    def gather(self, obj: Any, what: str = "gathering the ranks' results") -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        self._collective(what, dist.all_gather_object, out, obj)
        return out

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers to every rank (the start of a job)."""
        import torch.distributed as dist

        with torch.no_grad():
            for name, t in sorted(module.state_dict(keep_vars=True).items()):
                if isinstance(t, torch.Tensor) and t.numel():
                    buf = t.detach().to(self.device).contiguous()
                    self._collective(f"broadcasting {name}", dist.broadcast, buf, 0)
                    t.data.copy_(buf.to(t.device))

    # ---------------------------------------------------------------- update rounds

    def request(self, round_: int, stop: bool = False) -> None:
        """This rank is ready for update round ``round_`` (once per rank and round); a stop
        counts for every rank, so it starts the round whoever else is ready."""
        self._collective("asking for an update", self.store.add, f"r{round_}", self.world_size if stop else 1)

    def requested(self, round_: int, ranks: int = 1) -> bool:
        """Whether at least ``ranks`` ranks are ready for round ``round_`` (or one stopped)."""
        return int(self._collective("reading the job's store", self.store.add, f"r{round_}", 0)) >= ranks

    def header(self, values: list[float], state: dict | None) -> list[list[float]]:
        """The start of an update: every rank's ``values`` (row ``r`` is rank ``r``'s), after
        checking that every rank holds the same weights (``state``: the state dict published
        last; None before the first update). One all-reduce: rank ``r`` fills row ``r`` and
        a max over ranks fills the rest."""
        k = len(values)
        rows = torch.full((self.world_size, k + 1), -math.inf, dtype=torch.float64)
        rows[self.rank] = torch.tensor([*values, float(_checksum(state)) if state is not None else 0.0],
                                       dtype=torch.float64)
        out = self.all_max(rows.reshape(-1), "an update's header").reshape(self.world_size, k + 1)
        if state is not None:
            sums = out[:, k]
            if not bool((sums == sums[0]).all()):
                raise RanksDivergedError(f"the ranks' weights differ after an update (checksums by rank "
                                         f"{[int(v) for v in sums.tolist()]}): data-parallel updates must keep "
                                         "them identical")
            self.checks += 1
        return out[:, :k].tolist()

    def agree_steps(self, n: int, minibatch_size: int) -> int:
        """Minibatch steps per epoch for this update: the most any rank needs."""
        need = math.ceil(n / minibatch_size) if n else 0
        return int(self.all_max(torch.tensor([float(need)], dtype=torch.float64), "agreeing on minibatches")[0])

    def reduce_grads(self, params: list[torch.nn.Parameter], rows: int, finite: bool) -> bool:
        """Replace every rank's gradients with their rows-weighted mean (``sum_r rows_r g_r /
        sum_r rows_r``); False (and no gradients) if any rank's loss was NaN/inf. A parameter
        no rank has a gradient for keeps none, as in one process."""
        ref = params[0]
        dtype = torch.promote_types(ref.dtype, torch.float32)  # row counts and flags exact, no fp16 overflow
        parts, has = [], []
        for p in params:
            if p.grad is not None and rows and finite:
                parts.append(p.grad.detach().reshape(-1).to(dtype) * rows)
                has.append(1.0)
            else:
                parts.append(torch.zeros(p.numel(), dtype=dtype, device=ref.device))
                has.append(0.0)
        tail = torch.tensor([*has, float(rows if finite else 0), 0.0 if finite else 1.0], dtype=dtype,
                            device=ref.device)
        flat = self.all_sum(torch.cat(parts + [tail]), "a gradient all-reduce")
        total, bad = float(flat[-2]), float(flat[-1])
        if bad > 0:
            for p in params:
                p.grad = None
            return False
        offset = 0
        for p, flag in zip(params, flat[-2 - len(params):-2].tolist()):
            n = p.numel()
            p.grad = (flat[offset:offset + n] / total).reshape(p.shape).to(p.dtype) if flag > 0 and total > 0 else None
            offset += n
        return True

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: statistics merged during an update (observations, rewards) are all-reduced."""
        token = _active.set(self)
        try:
            yield
        finally:
            _active.reset(token)


def active() -> DataParallel | None:
    """The data-parallel job an update in this thread belongs to, or None."""
    return _active.get()


def reduce_moments(n: int, shifted_sum: torch.Tensor, shifted_sq: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``(N, sum, sum of squares)`` over every rank of a batch's deviations from a centre that
    every rank shares (the running mean before the batch); the local values outside a job."""
    dp = active()
    if dp is None:
        return float(n), shifted_sum, shifted_sq
    d = shifted_sum.numel()
    buf = torch.cat([torch.tensor([float(n)], dtype=torch.float64), shifted_sum.double().reshape(-1),
                     shifted_sq.double().reshape(-1)])
    out = dp.all_sum(buf, "merging observation or reward statistics")
    return float(out[0]), out[1:1 + d].reshape(shifted_sum.shape), out[1 + d:].reshape(shifted_sq.shape)


# ---------------------------------------------------------------- a rank's run


def rank_seed(seed: int, rank: int) -> int:
    """Rank ``rank``'s run seed: ``seed`` on rank 0 (a one-rank job is the one-process run),
    else one drawn from ``(seed, rank)``, below 2**31 so that ``seed + env + resets`` stays a
    32-bit seed (legacy ``RandomState`` seeding, as dm_control's, needs one).

        >>> rank_seed(7, 0), rank_seed(7, 1) == rank_seed(7, 1), rank_seed(7, 1) != rank_seed(7, 2)
        (7, True, True)
    """
    if rank == 0:
        return seed
    import numpy as np

    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0]) >> 1


def rank_config(cfg, dp: DataParallel):
    """Rank ``dp.rank``'s RunConfig: its share of the env steps, its own seeds, the log
    directory on rank 0 only, and the learner in a thread (collectives need this process)."""
    import dataclasses

    from ebrl.config import ConfigError, LearnerMode

    if cfg.learner is LearnerMode.PROCESS:
        raise ConfigError("learner", cfg.learner.value, "a data-parallel rank trains in its own process (its "
                          "collectives live there): use learner='thread' or 'auto'")
    if cfg.total_env_steps < dp.world_size:
        raise ConfigError("total_env_steps", cfg.total_env_steps, f"gives some of the {dp.world_size} ranks no step")
    step = cfg.faults.step_timeout_s
    if step is not None and cfg.faults.collective_timeout_s <= step:
        raise ConfigError("faults.collective_timeout_s", cfg.faults.collective_timeout_s,
                          f"must exceed faults.step_timeout_s ({step:g}): a rank replacing a hung env is not dead")
    return dataclasses.replace(
        cfg, total_env_steps=rank_share(cfg.total_env_steps, dp.rank, dp.world_size),
        seed=rank_seed(cfg.seed, dp.rank), learner=LearnerMode.THREAD,
        log_dir=cfg.log_dir if dp.rank == 0 else None,
        checkpoint_every_s=cfg.checkpoint_every_s if dp.rank == 0 else None)


def reseed_sampling(policy, seed: int) -> None:
    """Restart a policy's sampling streams (``_gen``, ``_np_rng``) from ``seed``."""
    import numpy as np

    policy.seed = seed
    gen = getattr(policy, "_gen", None)
    if isinstance(gen, torch.Generator):
        gen.manual_seed(seed)
    if hasattr(policy, "_np_rng"):
        policy._np_rng = np.random.default_rng(seed)


_SUMMED = ("env_steps", "trained", "in_flight_at_stop", "env_failures", "episodes", "learner_wakeups", "migrations",
           "timeouts", "respawns", "skipped_updates")


def combine_results(dp: DataParallel, result, rank_hash: str):
    """The job's :class:`~ebrl.runtime.stats.RunResult` from every rank's: counters summed,
    histograms merged, scores averaged over the ranks' recent episodes, and per rank its
    env steps, wall time, score and weights' hash. Every rank gets the same."""
    import dataclasses

    mine = {k: getattr(result, k) for k in _SUMMED}
    mine.update(dropped=result.dropped, lag_hist=result.lag_hist, gen_batch_hist=result.gen_batch_hist,
                steps_per_env=result.steps_per_env, wall_s=result.wall_s, mean_return=result.mean_return,
                success_once=result.success_once, success_at_end=result.success_at_end,
                recent=min(result.episodes, 100), hash=rank_hash, updates=result.updates)
    ranks = dp.gather(mine)
    out = {k: sum(r[k] for r in ranks) for k in _SUMMED}
    for key in ("dropped", "lag_hist", "gen_batch_hist"):
        merged: dict = {}
        for r in ranks:
            for k, v in r[key].items():
                merged[k] = merged.get(k, 0) + v
        out[key] = dict(sorted(merged.items()))

    def recent_mean(key: str) -> float:  # each rank's score is over its last (up to) 100 episodes
        pairs = [(r[key], r["recent"]) for r in ranks if r["recent"] and not math.isnan(r[key])]
        n = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / n if n else math.nan

    lag_n, gen_n = sum(out["lag_hist"].values()), sum(out["gen_batch_hist"].values())
    wall = max(r["wall_s"] for r in ranks)
    return dataclasses.replace(
        result, **out, wall_s=wall, env_steps_per_s=out["env_steps"] / wall if wall > 0 else math.inf,
        lag_mean=sum(k * v for k, v in out["lag_hist"].items()) / lag_n if lag_n else 0.0,
        lag_max=max(out["lag_hist"], default=0),
        gen_batch_mean=sum(k * v for k, v in out["gen_batch_hist"].items()) / gen_n if gen_n else 0.0,
        mean_return=recent_mean("mean_return"), success_once=recent_mean("success_once"),
        success_at_end=recent_mean("success_at_end"),
        steps_per_env=[n for r in ranks for n in r["steps_per_env"]],
        world_size=dp.world_size, rank=dp.rank, rank_weight_hashes=[r["hash"] for r in ranks],
        ranks=[{"rank": i, "env_steps": r["env_steps"], "trained": r["trained"], "wall_s": r["wall_s"],
                "updates": r["updates"], "mean_return": r["mean_return"], "episodes": r["episodes"]}
               for i, r in enumerate(ranks)],
        weight_checks=dp.checks)
