"""The learner's side of the rollout storage: closed segment slots gathered into one
:class:`~ebrl.algos.batch.Batch` (:func:`collate`), in the learner's stage thread: one attribute
per field of the rollout's schema (:mod:`ebrl.runtime.fields`), padded with the field's fill."""

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
    store = rollout.store

    def gather(buf, fill):
        def leaf(a):
            out = a[slots, :T]
            for i in short:
                out[i, ns[i]:] = fill
            return torch.from_numpy(out)
        return tree_map(leaf, buf)

    finals = [(i, t, o) for i, s in enumerate(slots) for t, o in sorted(rollout.slot_final[s].items())]
    boot = tree_map(lambda a: torch.from_numpy(a[slots]), store["bootstrap_obs"])
    if finals:
        final_obs = tree_map(lambda *xs: torch.from_numpy(np.stack(xs)), *(o for _, _, o in finals))
        final_index = torch.tensor([(i, t) for i, t, _ in finals], dtype=torch.int64)
    else:
        final_obs = index(boot, slice(0, 0))
        final_index = torch.zeros((0, 2), dtype=torch.int64)
    group = torch.from_numpy(rollout.slot_group[slots]) if rollout.cut_at_episode_end else None
    return Batch(**{f.name: gather(store[f.name], f.pad(learner_version)) for f in rollout.schema},
                 mask=torch.from_numpy(mask), bootstrap_obs=boot, final_obs=final_obs, final_index=final_index,
                 learner_version=learner_version, group=group)
