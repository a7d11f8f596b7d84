"""Imported by verl's workers (`actor_rollout_ref.model.external_lib`): registers our GSPO/GRPO
losses, the `omni_group` advantage estimator and the `omni` reward manager in verl."""

from .verl_backend import register_into_verl

REGISTERED = register_into_verl()
