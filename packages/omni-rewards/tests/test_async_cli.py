from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
from omni_rewards_testutils import render_text, solid
from PIL import Image

from omni_rewards import Reward, RewardOutput, load_reward
from omni_rewards.cli import main


class _Handshake(Reward):
    """A reward whose scoring of batch k waits until the rollout of batch k + 1 has begun.

    If `ascore` scored on the event loop's thread (or the trainer awaited it before rolling
    out the next batch), that rollout could not begin and the wait would time out: the test
    proves the overlap by this handshake, not by wall-clock margins that a loaded machine
    can break.
    """

    name = "handshake"

    def __init__(self, num_batches: int, **kw):
        super().__init__(**kw)
        self.rollout_started = [threading.Event() for _ in range(num_batches)]
        self.scoring_started = [threading.Event() for _ in range(num_batches)]
        self.saw_next_rollout: dict[int, bool] = {}
        self.threads: set[int] = set()

    def score_batch(self, inp):
        self.threads.add(threading.get_ident())
        k = int(inp.prompts[0].removeprefix("batch "))
        self.scoring_started[k].set()
        if k + 1 < len(self.rollout_started):
            self.saw_next_rollout[k] = self.rollout_started[k + 1].wait(10)
        return RewardOutput(np.arange(inp.batch_size, dtype=np.float32))


def test_ascore_overlaps_with_next_rollout():
    num_batches = 4
    reward = _Handshake(num_batches)
    saw_previous_scoring: dict[int, bool] = {}

    def rollout(k: int) -> None:  # batch k's rollout, in a worker thread as a trainer's is
        reward.rollout_started[k].set()
        if k > 0:
            saw_previous_scoring[k] = reward.scoring_started[k - 1].wait(10)

    async def trainer():
        pending = []
        for k in range(num_batches):
            await asyncio.to_thread(rollout, k)
            pending.append(asyncio.create_task(reward.ascore(prompts=[f"batch {k}"] * 4)))
            await asyncio.sleep(0)  # submit batch k's scoring, go on with batch k+1
        return await asyncio.gather(*pending)

    outs = asyncio.run(trainer())
    assert all(o.scores.tolist() == [0, 1, 2, 3] for o in outs)
    # batch k was scored while batch k+1 rolled out, for every k
    assert reward.saw_next_rollout == {k: True for k in range(num_batches - 1)}
    assert saw_previous_scoring == {k: True for k in range(1, num_batches)}
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
