"""The local backend: the learner, the rollout and the reward in one process.

With LoRA the rollout engine samples with a merged copy of the policy
(`OmniModelBase.merged_rollout_copy`: the LoRA layers' weights are ``W0 + scale * B @ A``, every
other tensor is the learner's own), so its forwards cost the base model's; each weight sync
merges the new LoRA tensors into it, and the learner keeps its unmerged peft model. That also
lets `trainer.mode: async` sample step k+1 while step k trains. In the synchronous loop with an
EMA adapter (validation samples with it) and in full fine-tuning the engine samples with the
learner's own module (a weight sync only bumps the version); in async full fine-tuning it gets a
deep copy. With `algorithm.reuse_rollout_forward` (the update back-propagates through the
rollout's own forwards) the engine runs the trained SDE steps' forwards on the learner's own
module, with autograd, and every other forward on its rollout model.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..algorithms import algorithm
from ..errors import TrainError
from ..lr_schedule import apply_learning_rate
from ..models import build_optimizer, load_policy, load_trainable, quiet_libraries
from ..ports import Ports
from ..recipe import Recipe, RecipeError
from ..rewards import build_reward
from ..updates import (
    LocalCollective,
    UpdateContext,
    UpdateSettings,
    batch_rows,
    reuse_memory_check,
    rows_budget,
    run_update,
    select_rows,
    update_plans,
)

__all__ = ["LocalLearner", "ThinkerRollout", "make_local_ports"]


class LocalLearner:
    """The policy and its AdamW in this process; updates run on one rank."""

    world_size = 1

    def __init__(self, recipe: Recipe, adapter: Any, allowed_tokens: list[int] | None = None):
        self.recipe = recipe
        self.adapter = adapter
        self.params_named = adapter.named_trainable_parameters()
        self.optimizer = build_optimizer(list(self.params_named.values()), recipe)
        self.ctx = UpdateContext(
            adapter,
            self.optimizer,
            list(self.params_named.values()),
            algorithm(recipe.algorithm.name),
            UpdateSettings.from_recipe(recipe, allowed_tokens),
            LocalCollective(),
        )
        self.rows_budget = rows_budget(recipe, adapter)
        self.rows_fit: int | None = None  # measured after the first update (auto)
        # reuse_rollout_forward: the rollout's graph of the whole batch, checked against the
        # free memory at its first forward with autograd (the engine runs on this adapter)
        self.reuse_memory = reuse_memory_check(recipe, adapter)

    def update(self, batch: Any, step: int, correction: str | None = None) -> dict[str, float]:
        lr = apply_learning_rate(self.optimizer, self.recipe, step)
        (plan,) = update_plans(self.recipe, batch, step, world_size=1, rows_fit=self.rows_fit)
        if plan.rows != list(range(batch_rows(batch))):  # rows no minibatch uses are left out
            batch = select_rows(batch, plan.rows)
        out = {**run_update(self.ctx, batch, plan, correction=correction), "optim/lr": lr}
        if self.rows_budget is not None:
            self.rows_fit = self.rows_budget.rows_fit()
            out["perf/rows_fit"] = float(self.rows_fit or 0)
        return out

    def rollout_weights(self) -> dict[str, Tensor]:
        return self.adapter.export_rollout_weights()

    def lora_export(self) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
        if not self.recipe.lora.enabled:
            return None
        return self.adapter.export_rollout_weights(fmt="peft"), self.adapter.lora_config()

    def lora_config(self) -> dict[str, Any] | None:
        return self.adapter.lora_config() if self.recipe.lora.enabled else None

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
        out = {k: p.detach() for k, p in self.params_named.items()}
        if self.recipe.optimizer.ema_decay > 0:
            out.update(
                {f"ema/{k}": v.detach() for k, v in self.adapter.adapter_state("ema").items()}
            )
        return out, self.optimizer.state_dict()

    def load_state(self, trainable: dict[str, Tensor], optimizer: dict[str, Any] | None) -> None:
        load_trainable(self.adapter, self.params_named, trainable, self.recipe)
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)

    @contextlib.contextmanager
    def eval_weights(self) -> Iterator[None]:
        if self.recipe.optimizer.ema_decay > 0:
            with self.adapter.use_adapter("ema"):
                yield
        else:
            yield

    def close(self) -> None:
        if self.rows_budget is not None:
            self.rows_budget.close()
        if self.reuse_memory is not None:
            self.reuse_memory.close()


class ThinkerRollout:
    """Sampling from a thinker adapter in chunks of `rollout.max_num_seqs`, padded to
    `rollout.max_new_tokens`, with the constrained-decoding ids of `rollout.allowed_tokens`."""

    def __init__(self, adapter: Any, recipe: Recipe, allowed_tokens: list[int] | None) -> None:
        self.adapter = adapter
        self.recipe = recipe
        self.allowed_tokens = allowed_tokens
        self.version = 0

    def generate(
        self, items: list[Any], seeds: list[int], *, temperature: float, top_p: float
    ) -> dict[str, Any]:
        r = self.recipe.rollout
        t_max = r.max_new_tokens
        toks, lps, masks, texts = [], [], [], []
        forwards = 0
        temp_out = 1.0
        with torch.no_grad():
            for s in range(0, len(items), r.max_num_seqs):
                chunk = items[s : s + r.max_num_seqs]
                images = [it.image for it in chunk if it.image is not None]
                batch = self.adapter.build_batch(
                    [it.content() for it in chunk], images=images or None
                )
                out = self.adapter.generate(
                    batch,
                    max_new_tokens=t_max,
                    temperature=temperature,
                    top_p=top_p,
                    seed=seeds[s : s + len(chunk)],
                    allowed_tokens=self.allowed_tokens,
                )
                temp_out = float(out.get("temperature", temperature or 1.0))
                pad = t_max - out["tokens"].shape[1]
                toks.append(torch.nn.functional.pad(out["tokens"], (0, pad)))
                lps.append(torch.nn.functional.pad(out["log_probs"].float(), (0, pad)))
                masks.append(torch.nn.functional.pad(out["mask"].bool(), (0, pad)))
                texts.extend(out["texts"])
                forwards += out["tokens"].shape[1]
        return {
            "tokens": torch.cat(toks),
            "log_probs": torch.cat(lps),
            "mask": torch.cat(masks),
            "texts": texts,
            "temperature": temp_out,
            "forwards": forwards,
        }

    def update_weights(self, tensors: dict[str, Tensor], version: int) -> None:
        """Sampling runs on the trained module itself here: a sync is a version bump."""
        self.version = version


def allowed_token_ids(adapter: Any, recipe: Recipe) -> list[int] | None:
    """`rollout.allowed_tokens` as the thinker's token ids (None: unconstrained)."""
    if not recipe.rollout.allowed_tokens:
        return None
    try:
        return adapter.allowed_token_ids(recipe.rollout.allowed_tokens)
    except ValueError as exc:
        msg = str(exc).removeprefix("allowed_tokens: ")
        raise RecipeError(f"rollout.allowed_tokens: {msg}") from None


def make_local_ports(recipe: Recipe) -> Ports:
    """Learner, rollout and reward of `trainer.backend: local`."""
    r = recipe
    if isinstance(r.trainer.threads, int):
        torch.set_num_threads(r.trainer.threads)
    quiet_libraries()
    adapter = load_policy(r)
    alg = algorithm(r.algorithm.name)
    if alg.model == "omni":
        from omni_adapters.thinker import ThinkerAdapter

        if not isinstance(adapter, ThinkerAdapter):
            raise TrainError(
                f"model.path: {r.model.path} is a {type(adapter).__name__}, not an "
                f"autoregressive (thinker) model; {alg.name} trains omni models such as Qwen3-Omni"
            )
        allowed = allowed_token_ids(adapter, r)
        learner = LocalLearner(r, adapter, allowed)
        return Ports(learner, ThinkerRollout(adapter, r, allowed), lambda: build_reward(r))

    from diffusion_rollout import EmbeddedEngine

    needs_images = bool(getattr(adapter, "needs_images", False))
    if r.rollout.backend != "embedded":  # a server or vllm-omni samples; the trainer trains
        learner = LocalLearner(r, adapter)
        from ..models import ensure_model
        from .remote_rollout import make_remote_rollout

        remote = make_remote_rollout(r, ensure_model(r), learner.lora_config())
        return Ports(
            learner,
            remote,
            lambda: build_reward(r),
            needs_images=needs_images,
            closers=[remote.close],
        )
    # The rollout's copy is made before the learner, whose memory watches (forward hooks on
    # the adapter's first block) a deep copy would carry along.
    rollout_adapter = adapter
    merge = r.trainer.mode == "async" or r.optimizer.ema_decay == 0
    if r.lora.enabled and merge:
        rollout_adapter = adapter.merged_rollout_copy()
    elif r.trainer.mode == "async":  # the rollout of step k+1 overlaps the update of step k
        rollout_adapter = copy.deepcopy(adapter)
        rollout_adapter.set_trainable("frozen")
    learner = LocalLearner(r, adapter)
    # reuse_rollout_forward: the trained steps' forwards run on the learner's own (unmerged)
    # weights with autograd, so the update back-propagates through them; the rest stay merged
    engine = EmbeddedEngine(
        rollout_adapter,
        max_num_seqs=r.rollout.max_num_seqs,
        grad_denoiser=adapter if r.reuses_rollout_forward() else None,
    )
    return Ports(
        learner,
        engine,
        lambda: build_reward(r),
        decode_av=getattr(adapter, "decode_av", None),
        needs_images=needs_images,
        closers=[engine.close],
    )
