"""The emulated device's model against a measurement on a real GPU.

    python bench/emulator_vs_gpu.py gpu_pi0.json [--profile pi0-h200] [--out emulator_vs_gpu.json]

Reads what ``bench/gpu_pi0.py`` measured (``act_ms`` per batch size, per model) and prints, per
batch size, the measured milliseconds of a π0 call next to what the profile models
(:meth:`ebrl.emulated.DeviceProfile.act_s`, 10 denoising steps, all SMs), and their ratio. The
measurement runs π0 in eager PyTorch with two cameras; the profile models a compiled π0 with
three (docs/gpu.md): a ratio far from 1 says by how much this card and this code differ from
the published figures, which is what the emulated results must be read against.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ebrl.emulated import PROFILES

ROWS = 64  # the decisions bench/gpu_pi0.py's PPO update trains on, in one minibatch


def compare(measured: dict, profile: str) -> list[dict]:
    p = PROFILES[profile]
    rows = []
    for result in measured["results"]:
        model = Path(result.get("path", "?")).name
        for batch, ms in sorted(result.get("act_ms", {}).items(), key=lambda kv: int(kv[0])):
            modelled = p.act_s(int(batch)) * 1e3
            rows.append({"model": model, "call": "act", "batch": int(batch), "measured_ms": ms,
                         "modelled_ms": modelled, "measured/modelled": ms / modelled})
        if "update_s" in result:  # one PPO step on 64 decisions (LoRA rank 32: the profile models full training)
            modelled = p.train_s(ROWS) * 1e3
            rows.append({"model": model, "call": "train step (LoRA)", "batch": ROWS,
                         "measured_ms": result["update_s"] * 1e3, "modelled_ms": modelled,
                         "measured/modelled": result["update_s"] * 1e3 / modelled})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", help="bench/gpu_pi0.py's JSON")
    ap.add_argument("--profile", default="pi0-h200", choices=sorted(PROFILES))
    ap.add_argument("--out", default="emulator_vs_gpu.json")
    args = ap.parse_args(argv)
    rows = compare(json.loads(Path(args.measured).read_text()), args.profile)
    print(f"| model | call | batch | measured ms | {args.profile} ms | measured/modelled |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['call']} | {r['batch']} | {r['measured_ms']:.1f} | {r['modelled_ms']:.1f} | "
              f"{r['measured/modelled']:.2f} |")
    Path(args.out).write_text(json.dumps({"profile": args.profile, "rows": rows}, indent=2) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
