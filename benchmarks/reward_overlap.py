"""How much reward time the rollout hides (`reward.overlap`), measured side by side.

The same FlowGRPO steps on the tiny SD3 (N samples in waves of `rollout.max_num_seqs` rows)
run with `reward.overlap` off (score the batch after the whole rollout) and on (score each
wave in a reward thread as soon as it finishes, while the next waves compute). Each setting
runs in its own process, interleaved over `--repeats` rounds; per round the median step is
taken. Three rewards:

- ``sleep``: brightness plus a wait per sample, a stand-in for a remote reward model (HTTP,
  another GPU): no CPU of its own, so the rollout can hide all of it but the last wave's;
- ``ocr``: the real OCR reward (rapidocr / onnxruntime), which competes with the rollout for
  the two cores;
- ``shapes``: the toy world's GenEval-style check (numpy and scipy), the quickstart's reward.

``--threads`` sets the rollout's torch threads (`trainer.threads`): 1 leaves a core of two
for the reward thread, 2 (torch's default) takes both. What the table in docs/performance.md
found is what `reward.overlap: auto` follows on a CPU rollout.

Prints, per reward: rollout and reward seconds per step, the reward's own compute time, and
the share of it hidden, ``(T_off - T_on) / reward_busy``, where T is the rollout-plus-reward
wall time of a step. With W waves at most (W - 1) / W of it can hide (the last wave's reward
runs after the rollout).

    uv run python benchmarks/reward_overlap.py                # N=40 in 5 waves, 3 rounds
    uv run python benchmarks/reward_overlap.py --rewards sleep --repeats 5
    uv run python benchmarks/reward_overlap.py --rewards shapes,ocr --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(
    reward: str, overlap: bool, n: int, wave: int, steps: int, delay: float, threads: int
) -> dict:
    """One process: `steps` loop steps; per-step medians of the loop's own timings."""
    import numpy as np

    import omni_rewards
    from omni_train import recipe_from_dict, train

    class Delayed(omni_rewards.Reward):
        """brightness after a wait per sample (a remote reward model's latency)."""

        name = "delayed_brightness"

        def __init__(self, delay_s: float = 0.02) -> None:
            super().__init__()
            self.delay_s = delay_s
            self.inner = omni_rewards.load_reward("brightness")

        def score_batch(self, inp):
            time.sleep(self.delay_s * len(inp))
            return self.inner(inp)

    omni_rewards.REWARDS["delayed_brightness"] = Delayed
    tmp = Path(tempfile.mkdtemp())
    reward_cfg = {
        "sleep": {"name": "delayed_brightness", "options": {"delay_s": delay}},
        "ocr": {"name": "ocr"},
        "shapes": {"name": "shapes"},
    }[reward]
    # every prompt quotes its text: the OCR reward refuses a prompt without a target
    prompts = ['a sign that says "OPEN"', 'a poster with "HELLO"', 'a mug with "CAFE"', '"SALE"']
    if reward == "shapes":  # the toy world's grammar (docs/toy_world.md)
        prompts = ["a red circle", "a blue square", "a green triangle", "a yellow cross"]
    per = max(1, n // 8)
    d = {
        "experiment": "overlap",
        "model": {"path": str(Path.home() / ".cache/omni-rl/tiny/sd3"), "tiny": "sd3"},
        "data": {"prompts": prompts, "prompts_per_step": per},
        "rollout": {
            "n": n // per,
            "height": 32,
            "width": 32,
            "num_steps": 8,
            "sde_window_size": 2,
            "sde_window_range": [0, 4],
            "max_num_seqs": wave,
        },
        "reward": {**reward_cfg, "overlap": overlap},
        "algorithm": {"name": "flow_grpo", "clip_range": 0.2},
        "trainer": {
            "steps": steps,
            "progress": False,
            "sample_every": 0,
            "threads": threads,
            "output_dir": str(tmp / "run"),
        },
    }
    rows = train(recipe_from_dict(d))[1:]  # step 0 warms up
    med = {
        k: float(np.median([r[k] for r in rows]))
        for k in ("timing/rollout_s", "timing/reward_s", "timing/reward_busy_s")
    }
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rewards", default="sleep,ocr")
    ap.add_argument("--n", type=int, default=40, help="samples per step")
    ap.add_argument("--wave", type=int, default=8, help="rows per wave (rollout.max_num_seqs)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.02, help="sleep reward: seconds per sample")
    ap.add_argument("--threads", type=int, default=1, help="the rollout's torch threads")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        reward, overlap = args.child.split(":")
        out = child(reward, overlap == "1", args.n, args.wave, args.steps, args.delay, args.threads)
        print("RESULT " + json.dumps(out))
        return
    waves = -(-args.n // args.wave)
    print(
        f"reward overlap: {args.n} samples in {waves} waves of {args.wave}, tiny SD3, "
        f"{args.threads} torch thread(s) on {len(os.sched_getaffinity(0))} cores, "
        f"{args.repeats} interleaved rounds, each setting in its own process"
    )
    for reward in args.rewards.split(","):
        got: dict[str, list[dict]] = {"0": [], "1": []}
        for rnd in range(args.repeats):
            for ov in ("0", "1") if rnd % 2 == 0 else ("1", "0"):
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    f"{reward}:{ov}",
                    "--n",
                    str(args.n),
                    "--wave",
                    str(args.wave),
                    "--steps",
                    str(args.steps),
                    "--delay",
                    str(args.delay),
                    "--threads",
                    str(args.threads),
                ]
                res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"child failed:\n{res.stderr[-3000:]}")
                got[ov].append(json.loads(line[0][len("RESULT ") :]))

        def med(ov: str, key: str, got: dict = got) -> float:
            return statistics.median(r[key] for r in got[ov])

        t_off = med("0", "timing/rollout_s") + med("0", "timing/reward_s")
        t_on = med("1", "timing/rollout_s") + med("1", "timing/reward_s")
        busy = med("0", "timing/reward_busy_s")
        print(f"\n[{reward}] per step (medians):")
        print(
            f"  overlap off: rollout {med('0', 'timing/rollout_s'):.3f} s + reward "
            f"{med('0', 'timing/reward_s'):.3f} s = {t_off:.3f} s"
        )
        print(
            f"  overlap on : rollout {med('1', 'timing/rollout_s'):.3f} s + unhidden reward "
            f"{med('1', 'timing/reward_s'):.3f} s = {t_on:.3f} s"
        )
        print(
            f"  reward compute {busy:.3f} s per step; hidden share (T_off - T_on) / reward = "
            f"{(t_off - t_on) / busy:.0%} (at most {(waves - 1) / waves:.0%} with {waves} waves);"
            f" step speed-up {t_off / t_on:.2f}x"
        )


if __name__ == "__main__":
    main()
