import omni_algos


def test_public_names_are_exported():
    for name in omni_algos.__all__:
        assert hasattr(omni_algos, name), name
    for name in (
        "step",
        "SDEStep",
        "sample_windows",
        "group_advantages",
        "LOSSES",
        "register",
        "LossOutput",
        "rollout_correction",
        "Correction",
        "ADVANTAGES",
    ):
        assert name in omni_algos.__all__
    assert omni_algos.sde.step is omni_algos.step
    assert omni_algos.losses.LOSSES is omni_algos.LOSSES
