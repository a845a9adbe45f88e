"""The policy-update options of ``algo``: every bad value is refused with a
ValueError that names the field, before any worker starts; every valid choice composes."""

from __future__ import annotations

import pytest

from tests.support.env import compose


# rollout.prompts_per_step=2 x rollout.n_samples_per_prompt=2 over 2 learners: 2 samples a rank
SMALL = ("rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "cluster.num_learners=2")


@pytest.mark.parametrize("overrides,fragment", [
    (("algo.steps_per_rollout=0",), "algo.steps_per_rollout=0 must be > 0"),
    (("algo.steps_per_rollout=-1",), "algo.steps_per_rollout=-1 must be > 0"),
    ((*SMALL, "algo.steps_per_rollout=3"),
     "algo.steps_per_rollout=3 exceeds the 2 samples each of the cluster.num_learners=2 ranks"),
    # the default job: 64 prompts x 8 samples over 2 learners = 256 a rank
    (("algo.steps_per_rollout=257",), "algo.steps_per_rollout=257 exceeds the 256 samples"),
    (("algo.loss_agg=foo",),
     "algo.loss_agg='foo': use one of token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"),
    (("algo.kl_estimator=k2",), "algo.kl_estimator='k2': use one of k1, k3"),
    (("algo.entropy_coef=-1",), "algo.entropy_coef=-1.0 must be >= 0"),
    (("algo.is_mask=geometric",), "algo.is_mask='geometric': use one of none, token, sequence"),
    (("algo.is_mask=token", "algo.is_mask_low=1.5"),
     "algo.is_mask_low=1.5 and algo.is_mask_high=2.0: need 0 <= is_mask_low <= 1 <= is_mask_high"),
    (("algo.is_mask=token", "algo.is_mask_high=0.9"),
     "algo.is_mask_low=0.5 and algo.is_mask_high=0.9: need 0 <= is_mask_low <= 1 <= is_mask_high"),
    (("algo.is_mask_low=-0.1",), "need 0 <= is_mask_low <= 1 <= is_mask_high"),
    (("algo.tis_cap=-1",), "algo.tis_cap=-1.0 must be >= 0"),
    (("algo.max_tokens_per_micro_batch=-1",), "algo.max_tokens_per_micro_batch=-1 must be >= 0"),
    # the default rollout: prompts up to 1024 tokens, responses up to 8
    (("algo.max_tokens_per_micro_batch=1000",),
     "algo.max_tokens_per_micro_batch=1000 cannot hold the longest possible sample, "
     "rollout.max_prompt_tokens + rollout.max_new_tokens = 1032 tokens; raise it to 1032 or more"),
    (("algo.max_tokens_per_micro_batch=64", "rollout.max_prompt_tokens=60"),
     "rollout.max_prompt_tokens + rollout.max_new_tokens = 68 tokens; raise it to 68 or more, "
     "or lower rollout.max_prompt_tokens"),
])
def test_bad_algo_values_name_the_field(overrides, fragment):
    with pytest.raises(ValueError) as e:
        compose(*overrides)
    assert fragment in str(e.value)


@pytest.mark.parametrize("overrides,field,value", [
    (("algo.steps_per_rollout=1",), "steps_per_rollout", 1),
    ((*SMALL, "algo.steps_per_rollout=2"), "steps_per_rollout", 2),  # one sample per mini-batch
    (("algo.steps_per_rollout=256",), "steps_per_rollout", 256),
    (("algo.loss_agg=token_mean",), "loss_agg", "token_mean"),
    (("algo.loss_agg=seq_mean_token_mean",), "loss_agg", "seq_mean_token_mean"),
    (("algo.loss_agg=seq_mean_token_sum_norm",), "loss_agg", "seq_mean_token_sum_norm"),
    (("algo.kl_estimator=k1", "algo.kl_coef=0.1"), "kl_estimator", "k1"),
    (("algo.kl_estimator=k3", "algo.kl_coef=0.1"), "kl_estimator", "k3"),
    (("algo.entropy_coef=0",), "entropy_coef", 0.0),
    (("algo.entropy_coef=0.01",), "entropy_coef", 0.01),
    (("algo.drop_zero_std_groups=true",), "drop_zero_std_groups", True),
    (("algo.drop_zero_std_groups=false",), "drop_zero_std_groups", False),
    (("algo.advantage_std_norm=false",), "advantage_std_norm", False),
    (("algo.is_mask=none",), "is_mask", "none"),
    (("algo.is_mask=token",), "is_mask", "token"),
    (("algo.is_mask=sequence", "algo.is_mask_low=0.999", "algo.is_mask_high=1.001"), "is_mask", "sequence"),
    (("algo.is_mask=token", "algo.is_mask_low=0"), "is_mask_low", 0.0),  # an upper bound only
    (("algo.is_mask=token", "algo.is_mask_low=1", "algo.is_mask_high=1"), "is_mask_high", 1.0),
    (("algo.is_mask=token", "algo.tis_cap=2.0"), "tis_cap", 2.0),  # mask, then truncate
    (("algo.max_tokens_per_micro_batch=1032",), "max_tokens_per_micro_batch", 1032),  # just the longest
    (("algo.max_tokens_per_micro_batch=64", "rollout.max_prompt_tokens=56"),
     "max_tokens_per_micro_batch", 64),
])
def test_valid_algo_choices_compose(overrides, field, value):
    assert getattr(compose(*overrides).algo, field) == value


def test_algo_defaults_are_todays_behaviour():
    a = compose().algo
    assert (a.steps_per_rollout, a.loss_agg, a.kl_estimator, a.entropy_coef, a.drop_zero_std_groups) == (
        1, "token_mean", "k3", 0.0, False)
    assert (a.tis_cap, a.is_mask) == (0.0, "none")  # no off-policy correction unless asked
    assert a.max_tokens_per_micro_batch == 0  # micro-batches of algo.micro_batch_size samples
