"""The learner's side of the rollout storage: closed segment slots gathered into one
:class:`~ebrl.algos.batch.Batch` (:func:`collate`), in the learner's stage thread."""

from __future__ import annotations

import numpy as np

from ebrl.runtime.rollout import RolloutQueue
from ebrl.spaces import index, tree_map


def collate(rollout: RolloutQueue, slots: list[int], learner_version: int):
    """Gather slots into a :class:`~ebrl.algos.batch.Batch` (left-aligned, masked), copying them
    out of the storage: one gather per field, padding only for cut segments."""
    import torch

    from ebrl.algos.batch import Batch

    ns = rollout.slot_n[slots]
    T = int(ns.max()) if len(slots) else 1  # no slots: an empty batch (a data-parallel rank with no rows)
    mask = np.arange(T)[None, :] < ns[:, None]
    short = np.flatnonzero(ns < T).tolist()
    f = rollout.fields

    def gather(buf, fill=0):
        def leaf(a):
            out = a[slots, :T]
            for i in short:
                out[i, ns[i]:] = fill
            return torch.from_numpy(out)
        return tree_map(leaf, buf)

    finals = [(i, t, o) for i, s in enumerate(slots) for t, o in sorted(rollout.slot_final[s].items())]
    boot = tree_map(lambda a: torch.from_numpy(a[slots]), f["bootstrap_obs"])
    if finals:
        final_obs = tree_map(lambda *xs: torch.from_numpy(np.stack(xs)), *(o for _, _, o in finals))
        final_index = torch.tensor([(i, t) for i, t, _ in finals], dtype=torch.int64)
    else:
        final_obs = index(boot, slice(0, 0))
        final_index = torch.zeros((0, 2), dtype=torch.int64)
    return Batch(
        obs=gather(f["obs"]),
        actions=gather(f["actions"]),
        logprobs=gather(f["logprobs"]),
        values=gather(f["values"]),
        rewards=gather(f["rewards"]),
        terminated=gather(f["terminated"], False),
        truncated=gather(f["truncated"], False),
        mask=torch.from_numpy(mask),
        versions=gather(f["versions"], learner_version),
        bootstrap_obs=boot,
        final_obs=final_obs,
        final_index=final_index,
        learner_version=learner_version,
        group=torch.from_numpy(rollout.slot_group[slots]) if rollout.cut_at_episode_end else None,
        chunk_rewards=gather(f["chunk_rewards"]) if "chunk_rewards" in f else None,
        chunk_steps=gather(f["chunk_steps"]) if "chunk_steps" in f else None,
    )
