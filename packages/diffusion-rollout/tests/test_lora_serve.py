"""LoRA weight updates to a served model: `diffusion-rollout serve --lora-*` or the first
update's ``lora_config`` gives the model its adapter, then `RolloutClient.update_weights` of
LoRA tensors works as the README shows.

The served model is omni-adapters' tiny SD3 (imported by the CLI by name, as `serve` does);
the trainer side is the same adapter class with the same LoRA config, exporting its tensors
the way omni-train pushes them. Without omni-adapters (the standalone wheel) the served-model
tests are skipped; the `LoraSpec` tests run everywhere.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from diffusion_rollout import EmbeddedEngine, RolloutClient, RolloutRequest, SamplingParams
from diffusion_rollout.lora import LoraSpec, ensure_lora, lora_tensor_names

P = SamplingParams(
    height=32, width=32, num_steps=4, sde_window_size=2, sde_window_range=(0, 3), output="latent"
)
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_v"]}


def test_lora_spec_reads_ours_and_peft_and_names_bad_fields():
    assert LoraSpec.from_dict(LORA) == LoraSpec(4, 8.0, ("to_q", "to_v"))
    peft = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_v"], "peft_type": "LORA"}
    assert LoraSpec.from_dict(peft) == LoraSpec(4, 8.0, ("to_q", "to_v"))
    assert LoraSpec.from_json('{"rank": 2, "alpha": 2}').target_modules == ()
    with pytest.raises(ValueError, match=r"lora_config\.alpha is required"):
        LoraSpec.from_dict({"rank": 4})
    with pytest.raises(ValueError, match=r"lora_config\.rank must be"):
        LoraSpec.from_dict({"rank": 0, "alpha": 1})
    with pytest.raises(ValueError, match=r"lora_config\.target_modules"):
        LoraSpec.from_dict({"rank": 4, "alpha": 4, "target_modules": "to_q"})
    with pytest.raises(ValueError, match="not valid JSON"):
        LoraSpec.from_json("{rank: 4")
    names = lora_tensor_names({"a.lora_A.weight": torch.zeros(1), "b.weight": torch.zeros(1)})
    assert names == ["a.lora_A.weight"]


def test_lora_spec_reads_peft_own_adapter_config(tmp_path):
    """The adapter_config.json that peft itself writes: a plain LoRA reads as one, and every
    setting that changes the adapter's arithmetic is refused by name."""
    import json

    peft = pytest.importorskip("peft")  # not in the standalone wheel's environment

    def written(config_class=peft.LoraConfig, **kw):
        config_class(r=4, target_modules=["to_q", "to_v"], **kw).save_pretrained(tmp_path)
        return json.loads((tmp_path / "adapter_config.json").read_text())

    spec = LoraSpec.from_dict(written(lora_alpha=8))
    assert (spec.rank, spec.alpha, sorted(spec.target_modules)) == (4, 8.0, ["to_q", "to_v"])
    for kw, field in [
        ({"use_rslora": True}, "use_rslora"),
        ({"use_dora": True}, "use_dora"),
        ({"rank_pattern": {"to_q": 8}}, "rank_pattern"),
        ({"alpha_pattern": {"to_q": 4}}, "alpha_pattern"),
        ({"bias": "lora_only"}, "bias"),
        ({"modules_to_save": ["proj_out"]}, "modules_to_save"),
    ]:
        with pytest.raises(ValueError, match=rf"lora_config\.{field}"):
            LoraSpec.from_dict(written(**kw))
    with pytest.raises(ValueError, match=r"lora_config\.peft_type"):
        LoraSpec.from_dict(written(peft.LoHaConfig))


def test_ensure_lora_needs_add_lora(toy):
    with pytest.raises(ValueError, match="lora_config: ToyDenoiser cannot add"):
        ensure_lora(toy, LORA)
    assert ensure_lora(toy, None, {"proj_out.bias": torch.zeros(4)}) is False


try:
    import omni_adapters as adapters
except ImportError:  # the standalone wheel: no served model to build
    adapters = None


@pytest.fixture(scope="module")
def tiny_sd3():
    if adapters is None:
        pytest.skip("needs omni-adapters (the tiny SD3 to serve)")
    return str(adapters.tiny.build("sd3", tempfile.mkdtemp() + "/tiny-sd3"))


def trainer_weights(tiny_sd3, seed, lora=LORA):
    """What the trainer pushes: LoRA tensors of the same family adapter, random nonzero B."""
    model = adapters.from_pretrained(tiny_sd3)
    model.add_lora(lora["rank"], lora["alpha"], target_modules=lora["target_modules"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.export_rollout_weights(), model.lora_config()


def reference(tiny_sd3, weights, requests):
    model = adapters.from_pretrained(tiny_sd3)
    if weights is not None:
        model.add_lora(LORA["rank"], LORA["alpha"], target_modules=LORA["target_modules"])
        model.load_weights(weights)
    with EmbeddedEngine(model) as engine:
        return engine.generate_many(requests)


def max_diff(a, b):
    return max(
        (getattr(x, n) - getattr(y, n)).abs().max().item()
        for x, y in zip(a, b)
        for n in ("latents", "log_probs", "final_latent")
    )


def reqs(version=None):
    return [
        RolloutRequest(f"a cat {i}", 10 + i, P.replace(weights_version=version), f"q{i}")
        for i in range(3)
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`diffusion-rollout serve` built from its argv by the CLI (default loader: omni-adapters
    by name), run by uvicorn in a thread on a loopback port."""

    def __init__(self, model, *extra):
        import uvicorn

        from diffusion_rollout.cli import build_parser, build_server

        self.port = free_port()
        argv = ["serve", "--model", model, "--port", str(self.port), "--max-wait-ms", "20"]
        args = build_parser().parse_args([*argv, *extra])
        app, self.engine = build_server(args)
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.close()


def test_serve_with_lora_flags_takes_lora_updates(tiny_sd3):
    """The README flow: serve with --lora-*, push LoRA tensors, sample on the new version."""
    w1, _ = trainer_weights(tiny_sd3, 1)
    flags = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "to_q,to_v"]
    with Served(tiny_sd3, *flags) as url:
        client = RolloutClient(url)
        before = client.generate(reqs())
        assert max_diff(before, reference(tiny_sd3, None, reqs())) <= 1e-5  # B = 0: base model
        answer = client.update_weights(w1, version=1)
        assert answer["version"] == 1 and answer["tensors"] == len(w1)
        after = client.generate_many(reqs(version=1))
        assert client.version == 1 and all(t.version == 1 for t in after)
        assert max_diff(after, reference(tiny_sd3, w1, reqs())) <= 1e-5
        assert max_diff(after, before) > 1e-3


def test_first_update_brings_the_lora_config(tiny_sd3):
    """Without --lora-*: LoRA tensors alone are refused (400 naming lora_config, nothing
    changes); with the trainer's peft config attached the adapter is added and they load; a
    later update with a contradicting config is refused."""
    w1, peft_cfg = trainer_weights(tiny_sd3, 1)
    w2, _ = trainer_weights(tiny_sd3, 2)
    with Served(tiny_sd3) as url:
        client = RolloutClient(url)
        with pytest.raises(ValueError, match=r"\(400\).*lora_config.*--lora-rank"):
            client.update_weights(w1, version=1)
        bad = {**peft_cfg, "r": 8}
        with pytest.raises(ValueError, match=r"\(400\).*lora_config\.rank is 8"):
            client.update_weights(w1, version=1, lora_config=bad)
        assert client.version == 0
        assert max_diff(client.generate(reqs()), reference(tiny_sd3, None, reqs())) <= 1e-5
        client.update_weights(w1, version=1, lora_config=peft_cfg)
        client.update_weights(w2, version=2)  # the adapter is there now
        got = client.generate(reqs(version=2))
        assert max_diff(got, reference(tiny_sd3, w2, reqs())) <= 1e-5
        with pytest.raises(ValueError, match=r"already has a LoRA adapter"):
            client.update_weights(w1, version=3, lora_config={**LORA, "alpha": 4.0})
        assert client.version == 2


def test_serve_flags_are_checked():
    from diffusion_rollout.cli import build_parser, lora_spec_from_args

    parse = build_parser().parse_args
    base = ["serve", "--model", "m", "--port", "8100"]
    assert lora_spec_from_args(parse(base)) is None
    spec = lora_spec_from_args(parse([*base, "--lora-rank", "4", "--lora-alpha", "8"]))
    assert spec == LoraSpec(4, 8.0, ())
    with pytest.raises(SystemExit, match="go together"):
        lora_spec_from_args(parse([*base, "--lora-rank", "4"]))


@pytest.mark.slow
def test_serve_command_end_to_end(tiny_sd3, tmp_path):
    """The `diffusion-rollout serve` command itself, in its own process, on a loopback port."""
    port = free_port()
    cmd = [
        *(sys.executable, "-m", "diffusion_rollout.cli", "serve"),
        *("--model", tiny_sd3, "--port", str(port), "--log-level", "warning"),
        *("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "to_q,to_v"),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        client = RolloutClient(f"http://127.0.0.1:{port}")
        client.wait_ready(timeout_s=120)
        w1, _ = trainer_weights(tiny_sd3, 1)
        client.update_weights(w1, version=1)
        got = client.generate(reqs(version=1))
        assert max_diff(got, reference(tiny_sd3, w1, reqs())) <= 1e-5
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_loads_the_model_with_the_dtype_and_options_given(tiny_sd3):
    """`--dtype` and `--model-options` reach omni_adapters.from_pretrained (omni-train passes
    its `model.dtype` and `model.options`, so a served rollout samples with the learner's
    weights dtype); a bad value is one line naming the flag."""

    from diffusion_rollout.cli import build_parser, build_server

    base = ["serve", "--model", tiny_sd3, "--port", "8100"]
    options = ["--model-options", '{"gradient_checkpointing": true}']
    _, engine = build_server(build_parser().parse_args([*base, "--dtype", "bfloat16", *options]))
    try:
        model = engine.denoiser.model
        assert next(model.parameters()).dtype == torch.bfloat16
        assert model.is_gradient_checkpointing
    finally:
        engine.close()
    _, engine = build_server(build_parser().parse_args(base))
    try:
        assert next(engine.denoiser.model.parameters()).dtype == torch.float32
    finally:
        engine.close()
    with pytest.raises(SystemExit, match=r"--model-options: a JSON object"):
        build_server(build_parser().parse_args([*base, "--model-options", "[1]"]))
    with pytest.raises(SystemExit, match=r"--dtype and --model-options are for the default"):
        build_server(build_parser().parse_args([*base, "--dtype", "bfloat16"]), lambda p, d: None)
