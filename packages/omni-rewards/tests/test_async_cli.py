from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
from omni_rewards_testutils import render_text, solid
from PIL import Image

from omni_rewards import Reward, RewardOutput, load_reward
from omni_rewards.cli import main


class _Slow(Reward):
    """A reward whose forward takes `delay` seconds of GIL-free time, like a model call."""

    name = "slow"

    def __init__(self, delay, **kw):
        super().__init__(**kw)
        self.delay = delay
        self.threads = set()

    def score_batch(self, inp):
        self.threads.add(threading.get_ident())
        time.sleep(self.delay)
        return RewardOutput(np.arange(inp.batch_size, dtype=np.float32))


def test_ascore_overlaps_with_next_rollout():
    reward = _Slow(0.3)
    events = []

    async def trainer(num_batches=4, rollout_s=0.3):
        pending = []
        t0 = time.monotonic()
        for k in range(num_batches):
            await asyncio.to_thread(time.sleep, rollout_s)  # rollout of batch k
            events.append(("rollout_done", k, time.monotonic() - t0))

            async def score(k=k):
                out = await reward.ascore(prompts=["p"] * 4)
                events.append(("scored", k, time.monotonic() - t0))
                return out

            pending.append(asyncio.create_task(score()))
            await asyncio.sleep(0)  # submit batch k's scoring, go on with batch k+1
        outs = await asyncio.gather(*pending)
        return outs, time.monotonic() - t0

    outs, total = asyncio.run(trainer())
    assert all(o.scores.tolist() == [0, 1, 2, 3] for o in outs)
    done = {k: t for e, k, t in events if e == "rollout_done"}
    scored = {k: t for e, k, t in events if e == "scored"}
    # the score of batch k arrives while batch k+1 is still rolling out
    for k in range(3):
        assert done[k] < scored[k] < done[k + 1] + 0.05, events
    # overlapped: well under the sequential 4 * (0.3 + 0.3) s
    assert total < 0.8 * 4 * 0.6, total
    assert threading.get_ident() not in reward.threads


def test_ocr_ascore_runs_off_the_event_loop_thread():
    ocr = load_reward("ocr")
    main_thread = threading.get_ident()
    seen = []
    orig = ocr.backend.read

    def read(img):
        seen.append(threading.get_ident())
        return orig(img)

    ocr.backend.read = read
    ocr.backend.read_many = lambda imgs: [read(i) for i in imgs]
    out = asyncio.run(ocr.ascore(images=[render_text("Hi")], prompts=['"Hi"']))
    assert out.scores[0] == pytest.approx(1.0)
    assert seen and main_thread not in seen


def test_score_cli_prints_table(tmp_path, capsys):
    files = []
    for name, rgb in (("red.png", (255, 0, 0)), ("blue.png", (0, 0, 255))):
        Image.fromarray(solid(rgb)).save(tmp_path / name)
        files.append(str(tmp_path / name))
    assert main(["score", "color_match", *files, "--prompt", "a red thing"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["file", "score", "distance"]
    assert lines[1].split()[1] == "1.0000" and lines[1].startswith(files[0])
    assert float(lines[2].split()[1]) < 0.2
    assert main(["score", "brightness", files[0], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scores"] == [pytest.approx(0.299, abs=1e-6)]
    assert main(["score", "jpeg_compressibility", *files, "-o", "quality=50"]) == 0
    with pytest.raises(SystemExit, match="no such file"):
        main(["score", "brightness", str(tmp_path / "missing.png")])
    with pytest.raises(SystemExit, match="--prompt: give one value or one per file"):
        main(["score", "color_match", *files, "--prompt", "a", "--prompt", "b", "--prompt", "c"])
    assert main(["list"]) == 0
    assert "ocr" in capsys.readouterr().out.split()
