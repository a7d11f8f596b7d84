"""Cost model for `trainer.backend: ray`: expected step time and speedup for N workers.

Measures, in this run and on the tiny SD3 model, the per-sample time of each component of a
FlowGRPO step (rollout, reward, update) with the local trainer, the per-sample cost of moving
a trajectory between processes (safetensors encode + decode, what the Ray backend does), and
the weight-sync time; then simulates a step with N actor workers, N rollout workers and
`--reward-workers` reward workers:

    sync:   T(N) = B t_roll / N + B t_rew / R + B t_upd / N + t_ar(N) + t_sync + B t_ser
    async:  T(N) = max(B t_roll / N, B t_rew / R + B t_upd / N + t_ar(N) + t_sync) + B t_ser

where B is the batch (prompts_per_step * n), t_ser the per-sample transfer cost, and
t_ar(N) = 2 (N - 1) / N * P / bw the ring all-reduce of the P trainable bytes at bandwidth bw
(`--bandwidth-gbs`, an assumption, not measured: default 100 GB/s for NVLink-class GPUs).
The async line is the staleness-1 pipeline (the rollout of step k+1 hides behind the update
of step k). Printed: the measured component shares and the expected speedup over local.

    python benchmarks/scaling.py --workers 1 2 4 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def measure(steps: int, batch_prompts: int, n: int) -> dict[str, float]:
    from diffusion_rollout.wire import trajectory_from_bytes, trajectory_to_bytes
    from omni_train.recipe import recipe_from_dict
    from omni_train.trainer import LocalTrainer

    tmp = Path(tempfile.mkdtemp(prefix="omni-scaling-"))
    r = recipe_from_dict(
        {
            "model": {"path": str(tmp / "model"), "tiny": "sd3"},
            "data": {
                "prompts": ["a red apple", "a blue lake", "a green meadow", "a yellow lemon"],
                "prompts_per_step": batch_prompts,
            },
            "rollout": {
                "n": n,
                "height": 32,
                "width": 32,
                "num_steps": 8,
                "sde_window_size": 2,
                "sde_window_range": [0, 4],
                "max_num_seqs": 32,
            },
            "reward": {"name": "color_match"},
            "algorithm": {"name": "flow_grpo", "clip_range": 0.2},
            "trainer": {"output_dir": str(tmp / "run"), "progress": False, "sample_every": 0},
        }
    )
    tr = LocalTrainer(r, tmp / "run")
    tr.setup()
    acc = {"rollout": 0.0, "reward": 0.0, "update": 0.0, "sync": 0.0, "ser": 0.0}
    B = batch_prompts * n
    for step in range(steps + 1):  # step 0 warms up
        t0 = time.perf_counter()
        b = tr.rollout(step)
        t1 = time.perf_counter()
        tr.score(b, step)
        t2 = time.perf_counter()
        tr.update(b, step)
        t3 = time.perf_counter()
        tr.sync_weights(step + 1)
        t4 = time.perf_counter()
        for t in b.trajectories:
            trajectory_from_bytes(trajectory_to_bytes(t))
        t5 = time.perf_counter()
        if step:
            for k, v in zip(acc, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                acc[k] += v / steps
    params = sum(p.numel() * p.element_size() for p in tr.params_named.values())
    return {
        "B": B,
        "t_roll": acc["rollout"] / B,
        "t_rew": acc["reward"] / B,
        "t_upd": acc["update"] / B,
        "t_sync": acc["sync"],
        "t_ser": acc["ser"] / B,
        "param_bytes": float(params),
    }


def step_time(m: dict[str, float], N: int, R: int, bw: float, mode: str) -> float:
    B = m["B"]
    ar = 0.0 if N == 1 else 2 * (N - 1) / N * m["param_bytes"] / bw
    train = B * m["t_rew"] / R + B * m["t_upd"] / N + ar + m["t_sync"]
    roll = B * m["t_roll"] / N
    ser = 0.0 if N == 1 and mode == "local" else B * m["t_ser"]
    if mode == "async":
        return max(roll, train) + ser
    return roll + train + ser


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reward-workers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--bandwidth-gbs", type=float, default=100.0)
    args = ap.parse_args()
    m = measure(args.steps, args.prompts, args.n)
    bw = args.bandwidth_gbs * 1e9
    local = step_time(m, 1, 1, bw, "local")
    tot = m["t_roll"] + m["t_rew"] + m["t_upd"]
    print(f"measured on the tiny model, batch B={m['B']} (shares of one local step):")
    print(
        f"  rollout {m['t_roll'] / tot:6.1%}  reward {m['t_rew'] / tot:6.1%}  "
        f"update {m['t_upd'] / tot:6.1%}"
    )
    print(
        f"  transfer per sample / rollout per sample = {m['t_ser'] / m['t_roll']:.3f}; "
        f"weight sync / local step = {m['t_sync'] / local:.3f}"
    )
    print(
        f"expected speedup over the local backend (reward workers = {args.reward_workers}, "
        f"all-reduce at {args.bandwidth_gbs:g} GB/s):"
    )
    print("  workers   sync   async(staleness 1)")
    for N in args.workers:
        s = local / step_time(m, N, args.reward_workers, bw, "sync")
        a = local / step_time(m, N, args.reward_workers, bw, "async")
        print(f"  {N:7d}  {s:5.2f}x  {a:5.2f}x")
    print("  (async assumes rollout and actor pools on separate devices; colocated pools")
    print("   time-share each device, so use the sync column for them)")


if __name__ == "__main__":
    main()
