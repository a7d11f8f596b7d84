"""Image-conditioned training (Qwen-Image-Edit): the tiny edit model through the engine and
the trainer's rollout / validation requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omni_train.errors import TrainError
from omni_train.prepare import prepare
from omni_train.recipe import recipe_from_dict


@pytest.fixture(scope="module")
def tiny_edit(tmp_path_factory) -> Path:
    from omni_adapters import tiny

    path = tmp_path_factory.mktemp("tiny") / "qwen_image_edit"
    tiny.build("qwen_image_edit", path, seed=0)
    return path


def edit_recipe(tmp_path: Path, model: Path, data: dict) -> dict:
    return {
        "experiment": "edit",
        "model": {"path": str(model), "tiny": "qwen_image_edit"},
        "lora": {"rank": 4, "alpha": 4},
        "data": {"prompts_per_step": 2, **data},
        "rollout": {
            "n": 2,
            "height": 32,
            "width": 32,
            "num_steps": 3,
            "true_cfg_scale": 4.0,
            "noise_level": 1.2,
            "sde_window_size": 1,
            "sde_window_range": [0, 2],
        },
        "reward": {"name": "brightness"},
        "trainer": {"steps": 1, "output_dir": str(tmp_path / "run"), "progress": False},
    }


def test_tiny_edit_rollout_batched_equals_alone(tiny_edit) -> None:
    from diffusion_rollout import EmbeddedEngine, RolloutRequest, SamplingParams
    from omni_adapters import from_pretrained

    adapter = from_pretrained(tiny_edit)
    params = SamplingParams(
        height=32, width=32, num_steps=4, true_cfg_scale=4.0, noise_level=1.2, sde_window_size=2
    )
    rng = np.random.default_rng(0)
    sizes = [(32, 32), (32, 32), (24, 40), (32, 32)]
    reqs = [
        RolloutRequest(
            f"make the background {c}",
            seed=10 + i,
            params=params,
            request_id=f"q{i}",
            image=rng.integers(0, 256, (*sizes[i], 3), dtype=np.uint8),
        )
        for i, c in enumerate(["red", "blue", "green", "red"])
    ]
    with EmbeddedEngine(adapter, max_num_seqs=1) as serial:
        alone = serial.generate_many(reqs)
    with EmbeddedEngine(adapter, max_num_seqs=4) as batched:
        packed = batched.generate_many(reqs)
    assert batched.stats()["waves"] == 1
    worst = 0.0
    for a, b in zip(alone, packed):
        assert a.window == b.window
        for name in ("latents", "log_probs", "final_latent"):
            worst = max(worst, (getattr(a, name) - getattr(b, name)).abs().max().item())
        assert a.condition["image_latents"].shape == (16, 8, 8)  # 32 px condition
    print(f"tiny Qwen-Image-Edit: max |alone - batch4| = {worst:.3g}")
    assert worst <= 1e-4
    assert not torch.equal(alone[0].final_latent, alone[3].final_latent)  # image matters


def test_loop_passes_each_rows_image(tmp_path: Path, tiny_edit) -> None:
    from omni_train_testutils import local_loop

    paths = prepare("edit", tmp_path / "edit", size=32, count=6)
    r = recipe_from_dict(edit_recipe(tmp_path, tiny_edit, {"file": str(paths["train"])}))
    loop = local_loop(r, tmp_path / "run")
    seen = []
    engine = loop.ports.rollout
    original = engine.generate_many
    engine.generate_many = lambda reqs: seen.append(list(reqs)) or original(reqs)
    trajs = engine.generate_many(loop.requests_for(0))
    rows = loop.data.rows_for_step(0)
    reqs = seen[-1]
    assert [q.prompt for q in reqs] == [t.prompt for t in trajs]
    for k, q in enumerate(reqs):
        assert np.array_equal(np.asarray(q.image), loop.data.image(rows[k // 2]))
    lat = [tr.condition["image_latents"] for tr in trajs]
    assert torch.equal(lat[0], lat[1]) and not torch.equal(lat[0], lat[2])
    loop.run_dir.mkdir(parents=True, exist_ok=True)
    loop.validate(0)
    val, k = seen[-1], r.trainer.val_samples_per_prompt
    assert len(val) == 2 * k
    for i, q in enumerate(val):  # validation prompt i // k is data row i // k, with its image
        assert q.prompt == loop.data.prompts[i // k]
        assert np.array_equal(np.asarray(q.image), loop.data.image(i // k))
    loop.ports.close()


def test_edit_model_without_images_names_data_file(tmp_path: Path, tiny_edit) -> None:
    from omni_train import train

    r = recipe_from_dict(edit_recipe(tmp_path, tiny_edit, {"prompts": ["make it red", "b"]}))
    with pytest.raises(TrainError, match=r"data.file: the model is image-conditioned"):
        train(r, tmp_path / "run")


@pytest.mark.slow
def test_edit_plus_cpu_twin_trains_a_step(tmp_path: Path) -> None:
    """The shipped edit recipe's CPU twin (Qwen-Image-Edit-Plus layout, one condition image
    per row) runs end to end: rollout with the rows' images, a FlowGRPO step, validation; and
    the same on the http rollout (a `diffusion-rollout serve` omni-train starts), where the
    condition images cross the wire, gives the same rewards, loss and validation."""
    from omni_train import train
    from omni_train.recipe import load_recipe

    repo = Path(__file__).resolve().parents[3]

    def run(name: str, *overrides: str) -> list[dict]:
        recipe = load_recipe(
            repo / "recipes" / "cpu" / "qwen_image_edit_lora_flowgrpo.yaml",
            [
                f"model.path={tmp_path / 'model'}",
                f"data.file={repo / 'recipes' / 'data' / 'edit_tiny' / 'train.jsonl'}",
                f"trainer.output_dir={tmp_path / name}",
                "trainer.steps=2",
                "trainer.val_every=2",
                "trainer.progress=false",
                *overrides,
            ],
        )
        assert recipe.model.tiny == "qwen_image_edit_plus"
        return train(recipe)

    rows = run("embedded")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows) and "val/reward_mean" in rows[1]
    served = run("http", "rollout.backend=http")
    for a, b in zip(rows, served, strict=True):
        for k in ("reward/mean", "reward/std", "loss", "val/reward_mean"):
            if k in a:
                assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a[k], b[k])
