"""One cosine over a chain of runs (TrainConfig.schedule_steps / schedule_offset): a leg
that continues the chain follows the long schedule where the earlier legs left it, instead
of restarting the cosine at the peak rate (research log: the warm restarts cost each leg
its first half). Checked against the closed form in numpy, against a single run of the
whole schedule, and the default (no chain) against optax's warmup + cosine as before."""

import numpy as np
import optax
import pytest

from dblast_jax.train import config as C
from dblast_jax.train import step as step_lib


def _cfg(**kw):
    return C.get_experiment("tiny_dflash").replace(**kw)


def _rates(config, steps):
    schedule = step_lib.lr_schedule(config)
    return np.array([float(schedule(t)) for t in steps])


def _closed_form(lr, total, alpha, s):
    s = np.minimum(np.asarray(s, float), total)
    return lr * (alpha + (1 - alpha) * 0.5 * (1 + np.cos(np.pi * s / total)))


def test_without_a_chain_the_schedule_is_warmup_then_cosine_over_the_run():
    config = _cfg(learning_rate=1e-3, warmup_fraction=0.1, num_steps=200, end_lr_fraction=0.05)
    warm = config.warmup_steps
    expected = optax.join_schedules(
        [optax.linear_schedule(0.0, 1e-3, warm),
         optax.cosine_decay_schedule(1e-3, 200 - warm, alpha=0.05)], [warm])
    steps = range(0, 201, 7)
    np.testing.assert_allclose(_rates(config, steps), [float(expected(t)) for t in steps],
                               rtol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_a_leg_follows_the_long_cosine_from_its_offset(alpha):
    config = _cfg(learning_rate=5e-4, warmup_fraction=0.0, num_steps=3000,
                  schedule_steps=50000, schedule_offset=26000, end_lr_fraction=alpha)
    steps = np.arange(0, 3001, 250)
    np.testing.assert_allclose(_rates(config, steps),
                               _closed_form(5e-4, 50000, alpha, 26000 + steps), rtol=1e-5)
    # far below the peak that a restarted cosine would start at
    assert _rates(config, [0])[0] < 0.6 * 5e-4


def test_legs_of_a_chain_join_into_one_run_of_the_whole_schedule():
    whole = _cfg(learning_rate=2e-3, warmup_fraction=0.0, num_steps=1000, schedule_steps=1000)
    legs = [_cfg(learning_rate=2e-3, warmup_fraction=0.0, num_steps=n, schedule_steps=1000,
                 schedule_offset=o) for o, n in ((0, 300), (300, 450), (750, 250))]
    joined = np.concatenate([_rates(leg, range(leg.num_steps)) for leg in legs])
    np.testing.assert_allclose(joined, _rates(whole, range(1000)), rtol=1e-6)


def test_a_legs_warmup_ramps_to_the_long_cosines_rate_not_to_the_peak():
    config = _cfg(learning_rate=5e-4, warmup_fraction=0.03, num_steps=3000,
                  schedule_steps=50000, schedule_offset=30000)
    warm = config.warmup_steps
    assert warm == 90
    rates = _rates(config, [0, warm // 2, warm, warm + 500])
    target = _closed_form(5e-4, 50000, 0.0, [30000, 30000 + warm // 2, 30000 + warm,
                                            30000 + warm + 500])
    assert rates[0] == 0.0
    np.testing.assert_allclose(rates[1], target[1] * (warm // 2) / warm, rtol=1e-5)
    np.testing.assert_allclose(rates[2:], target[2:], rtol=1e-5)


def test_the_chain_fields_come_from_command_line_overrides():
    config = C.apply_overrides(_cfg(num_steps=3000),
                               ["schedule_steps=50000", "schedule_offset=26000"])
    assert (config.schedule_steps, config.schedule_offset) == (50000, 26000)
    assert C.TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("fields, message", [
    (dict(schedule_offset=100), "needs schedule_steps"),
    (dict(schedule_steps=1000, schedule_offset=900, num_steps=200), "raise schedule_steps"),
    (dict(schedule_steps=-1), "must be >= 0"),
])
def test_a_chain_that_does_not_fit_its_schedule_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**fields)
