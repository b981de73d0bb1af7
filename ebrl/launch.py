"""Starting a data-parallel job's ranks (:mod:`ebrl.distributed`): on this machine through
torchrun's elastic agent, or on a Ray cluster with one rank per placement-group bundle.

    ebrl train --nproc 2 --set env=mujoco/HalfCheetah-v5        # launch_local
    ebrl launch --ray auto --nproc 8 --set env=...               # launch_ray: one rank per GPU
    ebrl launch --ray --nproc 2 --set env=...                    # a local Ray (one rank per CPU slot)

Either way every rank runs ``python -m ebrl train ARGS`` with torch.distributed's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). A rank that fails ends the job:
the launcher stops the others and reports the rank that failed first, and returns its exit
code (130 when the job was stopped by a signal: the ranks stop cleanly and rank 0 saves a
checkpoint).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid

STOPPED = 130  # a rank stopped by SIGINT/SIGTERM (ebrl train's exit code for "stopped early")
STOP_WAIT_S = 60.0  # how long a stopped Ray job's ranks get to finish their update and save


def describe_exit(code: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL`` for a process's return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch_local(nproc: int, argv: list[str]) -> int:
    """``nproc`` ranks of ``ebrl train ARGV`` on this machine, under torchrun's elastic agent
    (``torchrun --standalone``): a TCPStore on a free port, no restarts. Returns the job's exit
    code after printing one line naming the rank that failed, if one did."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2)
    # the ranks inherit the agent's environment: set for them, restored for the caller
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "EBRL_LAUNCHER_PID")}
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets per rank (and warns about)
    os.environ["EBRL_LAUNCHER_PID"] = str(os.getpid())  # the ranks exit if the launcher dies
    try:
        elastic_launch(config, sys.executable)("-m", "ebrl", *argv)
    except ChildFailedError as exc:
        codes = {rank: f.exitcode for rank, f in exc.failures.items()}
        if codes and all(c == STOPPED for c in codes.values()):
            return STOPPED
        rank, failure = exc.get_first_failure()
        print(f"ebrl: rank {rank} of {nproc} failed ({describe_exit(failure.exitcode)}); the job stopped "
              f"(exit codes by rank: {dict(sorted(codes.items()))})", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException:  # Ctrl-C or SIGTERM to the launcher: the agent stopped the ranks
        return STOPPED
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_ray(address: str | None, nproc: int, argv: list[str], *, gpus_per_rank: float | None = None,
               ray_init: dict | None = None) -> int:
    """``nproc`` ranks of ``ebrl train ARGV`` on Ray: a placement group of ``nproc`` bundles
    (one GPU each when the cluster has ``nproc`` GPUs, else one CPU), an actor in each, and the
    rank as a subprocess of its actor (a clean process for torch.distributed; it exits if its
    actor dies). ``address``: a Ray cluster (``"auto"``, ``"ray://..."``), or None for a local
    Ray; ``ray_init``: more ``ray.init`` keywords (tests pass ``num_cpus=2``)."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise RuntimeError("ebrl launch --ray needs Ray: pip install 'ebrl[ray]'") from None

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, **(ray_init or {}))
    try:
        if gpus_per_rank is None:
            gpus_per_rank = 1.0 if ray.cluster_resources().get("GPU", 0) >= nproc else 0.0
        bundle = {"CPU": 1.0, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
        group = placement_group([dict(bundle) for _ in range(nproc)], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=120)
        except Exception:
            remove_placement_group(group)
            raise RuntimeError(f"Ray could not place {nproc} ranks of {bundle} each (cluster: "
                               f"{ray.cluster_resources()})") from None
        Rank = ray.remote(max_concurrency=2)(_RankActor)  # run() and stop() at once
        actors = [Rank.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                               scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)
                               ).remote() for r in range(nproc)]
        try:
            host, port = ray.get(actors[0].address.remote())
            env = {"WORLD_SIZE": str(nproc), "MASTER_ADDR": host, "MASTER_PORT": str(port),
                   "TORCHELASTIC_RUN_ID": str(uuid.uuid4())}
            cpus = str(int(bundle["CPU"]))  # a rank sizes its pools to its bundle, not to the node
            runs = {actors[r].run.remote({**env, "RANK": str(r), "LOCAL_RANK": "0", "EBRL_CPUS": cpus}, argv): r
                    for r in range(nproc)}
            codes: dict[int, int] = {}
            pending = list(runs)
            try:
                while pending:
                    done, pending = ray.wait(pending, num_returns=1)
                    for ref in done:
                        r = runs[ref]
                        try:
                            codes[r] = ray.get(ref)
                        except Exception as exc:  # the actor died (its node, an OOM kill)
                            print(f"ebrl: rank {r} of {nproc} was lost ({type(exc).__name__}); the job stopped",
                                  file=sys.stderr)
                            return 1
                        if codes[r] not in (0, STOPPED):
                            print(f"ebrl: rank {r} of {nproc} failed ({describe_exit(codes[r])}); the job stopped",
                                  file=sys.stderr)
                            return codes[r] if codes[r] > 0 else 1
            except KeyboardInterrupt:  # Ctrl-C (SIGINT) to the launcher: each rank stops cleanly, then exits
                ray.get([a.stop.remote() for a in actors], timeout=10)
                ray.wait(pending, num_returns=len(pending), timeout=STOP_WAIT_S)
                return STOPPED
            return STOPPED if any(c == STOPPED for c in codes.values()) else 0
        finally:
            for a in actors:
                ray.kill(a)  # a rank still running exits with its actor
            remove_placement_group(group)
    finally:
        if started_here:
            ray.shutdown()


class _RankActor:
    """Hosts one rank: ``address`` on rank 0 picks the job's store address; ``run`` runs the
    rank; ``stop`` (called while ``run`` waits: the actor takes two calls at once) sends it
    SIGINT, which stops it cleanly (rank 0 saves the checkpoint)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def run(self, env: dict[str, str], argv: list[str]) -> int:
        child_env = {**os.environ, **env, "EBRL_LAUNCHER_PID": str(os.getpid()), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "ebrl", *argv], env=child_env)
        return self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
