"""OmniModelBase on a toy model: registry, config lookup, LoRA helper, FSDP, weight sync."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import omni_adapters
from omni_adapters.base import (
    ADAPTERS,
    OmniModelBase,
    adapter_for,
    read_adapter_options,
    read_architecture,
    register_adapter,
    weights_checksum,
    write_adapter_options,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(4, 4)
        self.to_k = nn.Linear(4, 4)
        self.ff = nn.Linear(4, 4)

    def forward(self, x):
        return self.ff(self.to_q(x) + self.to_k(x))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class ToyAdapter(OmniModelBase):
    trainable_component = "net"
    lora_target_modules = ("to_q", "to_k")
    no_split_modules = ("Block",)


@pytest.fixture()
def toy():
    return ToyAdapter({"net": Toy()})


def test_register_and_lookup_by_architecture_and_stage():
    @register_adapter("ToyArch", "thinker")
    class A(ToyAdapter):
        pass

    @register_adapter("ToyArch", "talker")
    class B(ToyAdapter):
        pass

    try:
        assert adapter_for("ToyArch", "thinker") is A
        assert A.architecture == "ToyArch" and A.stage == "thinker"
        with pytest.raises(ValueError, match="several stages"):
            adapter_for("ToyArch")
        with pytest.raises(ValueError, match="no stage 'x'"):
            adapter_for("ToyArch", "x")
        with pytest.raises(ValueError, match="already registered"):
            register_adapter("ToyArch", "thinker")(type("C", (ToyAdapter,), {}))
    finally:
        del ADAPTERS[("ToyArch", "thinker")], ADAPTERS[("ToyArch", "talker")]
    with pytest.raises(ValueError, match="no adapter registered"):
        adapter_for("NoSuchPipeline")


def test_read_architecture_prefers_model_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    assert read_architecture(tmp_path) == "FooForCausalLM"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FooPipeline"}))
    assert read_architecture(tmp_path) == "FooPipeline"
    (tmp_path / "model_index.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="_class_name"):
        read_architecture(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_architecture(tmp_path / "missing")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FooPipeline"}))
    with pytest.raises(ValueError, match="no adapter registered for 'FooPipeline'"):
        omni_adapters.from_pretrained(tmp_path)


def test_adapter_options_file_round_trip(tmp_path):
    assert read_adapter_options(tmp_path) == {}
    write_adapter_options(tmp_path, max_sequence_length=8)
    assert read_adapter_options(tmp_path) == {"max_sequence_length": 8}


def test_checksum_covers_names_dtypes_shapes_and_bytes():
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(2)}
    base = weights_checksum(a)
    assert base == weights_checksum(dict(reversed(list(a.items()))))
    assert base != weights_checksum({"x": a["x"].reshape(3, 2), "y": a["y"]})
    assert base != weights_checksum({"x": a["x"].double(), "y": a["y"]})
    assert base != weights_checksum({"z": a["x"], "y": a["y"]})
    b = {k: v.clone() for k, v in a.items()}
    b["y"][0] = 1.0000001
    assert base != weights_checksum(b)
    assert weights_checksum({"h": torch.ones(3, dtype=torch.bfloat16)})


def test_everything_starts_frozen_and_lora_trains_only_lora(toy):
    assert toy.trainable_parameters() == []
    n = toy.add_lora(2, alpha=4)
    assert n == 4 == toy.lora_module_count()
    names = set(toy.named_trainable_parameters())
    assert names == {
        f"blocks.{i}.{m}.lora_{ab}.default.weight"
        for i in range(2)
        for m in ("to_q", "to_k")
        for ab in "AB"
    }
    assert toy.lora_config()["r"] == 2 and toy.lora_config()["lora_alpha"] == 4


def test_zero_bound_modules_is_an_error(toy):
    with pytest.raises(ValueError, match="binds 0 modules"):
        toy.add_lora(2, target_modules=["nothing_here"])
    with pytest.raises(ValueError, match="binds 0 modules"):
        toy.add_lora(2, target_modules=["to_q"], exclude_modules=["to_q"], adapter_name="b")


def test_exclude_modules_skips_matches(toy):
    assert toy.add_lora(2, exclude_modules=["blocks.0.to_q"]) == 3


def test_full_and_frozen_modes(toy):
    n = toy.set_trainable("full", modules=["head"])
    assert n == 4 * 4 + 4
    assert set(toy.named_trainable_parameters()) == {"head.weight", "head.bias"}
    exported = toy.export_rollout_weights()
    assert set(exported) == {"head.weight", "head.bias"}
    assert toy.set_trainable("frozen") == 0
    with pytest.raises(ValueError, match="match no parameter"):
        toy.set_trainable("full", modules=["nope"])
    with pytest.raises(ValueError, match="mode"):
        toy.set_trainable("half")


def _set_random(adapter, name="default", seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in adapter.adapter_state(name).values():
            t.copy_(torch.randn(t.shape, generator=g))


def test_old_adapter_ema_and_reference_policy(toy):
    x = torch.randn(3, 4)
    with torch.no_grad():
        base = toy.model(x)
    toy.add_lora(2)
    _set_random(toy)
    toy.add_adapter_copy("default", "old")
    with torch.no_grad():
        cur = toy.model(x)
        with toy.use_adapter("old"):
            old = toy.model(x)
        with toy.disabled_adapters():
            ref = toy.model(x)
    torch.testing.assert_close(cur, old)
    torch.testing.assert_close(ref, base)
    assert not torch.allclose(cur, base)
    _set_random(toy, seed=1)
    before = {k: v.clone() for k, v in toy.adapter_state("old").items()}
    cur_w = toy.adapter_state("default")
    toy.ema_adapter("default", "old", decay=0.75)
    for k, v in toy.adapter_state("old").items():
        torch.testing.assert_close(v, 0.75 * before[k] + 0.25 * cur_w[k])
    # the trainable set is still exactly the default adapter after all the switching
    assert all(".default." in n for n in toy.named_trainable_parameters())
    assert len(toy.named_trainable_parameters()) == 8
    assert toy.active_adapter() == "default"
    with pytest.raises(ValueError, match="decay"):
        toy.ema_adapter("default", "old", decay=1.5)


def test_gradients_flow_to_lora_only(toy):
    toy.add_lora(2)
    _set_random(toy)
    toy.model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in toy.trainable_parameters())
    assert toy.model.head.weight.grad is None


def test_export_formats_and_strict_load(toy):
    toy.add_lora(2)
    _set_random(toy)
    w = toy.export_rollout_weights()
    assert "blocks.0.to_q.lora_A.weight" in w
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in w.values())
    v = toy.export_rollout_weights(fmt="vllm_omni")
    assert set(v) == {"base_model.model." + k for k in w}
    other = ToyAdapter({"net": Toy()})
    other.add_lora(2)
    other.load_weights(v)
    assert weights_checksum(other.export_rollout_weights()) == weights_checksum(w)
    missing = dict(w)
    missing.pop("blocks.0.to_q.lora_A.weight")
    with pytest.raises(ValueError, match="missing"):
        other.load_weights(missing)
    wrong = dict(w)
    wrong["blocks.0.to_q.lora_A.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        other.load_weights(wrong)
    with pytest.raises(ValueError, match="fmt"):
        toy.export_rollout_weights(fmt="onnx")


def test_load_weights_is_all_or_nothing(toy):
    """One changed good tensor next to a wrong-shape (or NaN) one: nothing is copied."""
    toy.add_lora(2)
    _set_random(toy)
    before = toy.export_rollout_weights()
    names = sorted(before)
    for bad in (torch.zeros(3, 3), torch.full_like(before[names[-1]], float("nan"))):
        update = {k: v + 1.0 for k, v in before.items()}
        update[names[-1]] = bad
        with pytest.raises(ValueError, match=names[-1].replace(".", r"\.")):
            toy.load_weights(update)
        after = toy.export_rollout_weights()
        assert all(torch.equal(before[k], after[k]) for k in names)


def test_fsdp_units_and_typos(toy):
    assert toy.fsdp_wrap_units() == [Block]
    assert len(toy.fsdp_wrap_modules()) == 2
    bad = type("Bad", (ToyAdapter,), {"no_split_modules": ("Blok",)})({"net": Toy()})
    with pytest.raises(ValueError, match="Blok"):
        bad.fsdp_wrap_units()
    mp = toy.fsdp_mixed_precision()
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32


def test_strip_modules(toy):
    toy.components["vae"] = nn.Linear(1, 1)
    assert toy.strip_modules(["vae", "blocks.1.ff"]) == ["vae", "blocks.1.ff"]
    assert "vae" not in toy.components and not hasattr(toy.model.blocks[1], "ff")
    with pytest.raises(ValueError, match="trainable component"):
        toy.strip_modules(["net"])
    with pytest.raises(ValueError, match="neither"):
        toy.strip_modules(["ghost"])


def test_tiny_build_rejects_unknown_family(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        omni_adapters.tiny.build("sd9", tmp_path)


def test_tiny_build_writes_its_stamp(tiny_path):
    """Every build records (family, seed, builder revision) so stale caches can be found."""
    tiny = omni_adapters.tiny
    stamp = json.loads((tiny_path("sd3") / tiny.STAMP_FILE).read_text())
    assert stamp == tiny.build_stamp("sd3", 0) == {"family": "sd3", "seed": 0, "revision": 1}
    assert tiny.build_stamp("qwen3_omni_thinker")["revision"] == 2  # the std 0.2 weights
    with pytest.raises(ValueError, match="unknown family 'sd9'"):
        tiny.build_stamp("sd9")


def test_save_peft_adapter_folder(toy, tmp_path):
    from safetensors.torch import load_file

    toy.add_lora(2, alpha=8)
    _set_random(toy)
    out = toy.save_peft_adapter(tmp_path / "lora")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (
        cfg["r"] == 2
        and cfg["lora_alpha"] == 8
        and sorted(cfg["target_modules"]) == ["to_k", "to_q"]
    )
    saved = load_file(out / "adapter_model.safetensors")
    assert saved.keys() == toy.export_rollout_weights("peft").keys()
    other = ToyAdapter({"net": Toy()})
    other.add_lora(2, alpha=8)
    other.load_weights(saved)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(other.model(x), toy.model(x))
    # and the folder is an adapter peft itself loads onto the base model
    import peft

    loaded = peft.PeftModel.from_pretrained(Toy(), out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), toy.model(x))
        with loaded.disable_adapter():
            torch.testing.assert_close(loaded(x), Toy()(x))
        assert not torch.allclose(loaded(x), Toy()(x))  # the adapter does change the output
