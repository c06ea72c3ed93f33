"""HeteroModelParallelStrategy (Lightning's FSDP2 strategy with hetsplit's shares) in a 2-rank gloo job, float64.

``tests/lightning_fsdp_job.py`` runs every scenario in one launch (Lightning's start-up is
most of the time); each scenario is its own test: the parameters after two epochs equal one
plain process's full-batch SGD on the same global batches; a resumed fit ends as the
uninterrupted one; setup refuses a model without one ``fully_shard`` root holding every
trainable parameter. The constructor's refusals need no launch.
"""

from __future__ import annotations

import lightning  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import torch.distributed.fsdp  # noqa: F401  (a test extra: missing, fail; never skip)
from integration_launch import check, job_fixture

from hetsplit.lightning import HeteroModelParallelStrategy

job = job_fixture("lightning_fsdp_job.py", timeout=240)


@pytest.mark.parametrize("name", ["uneven", "zero", "micro", "profiled"])
def test_steps_equal_full_batch_sgd(job, name):
    check(job, name)


def test_rebalancing_changes_the_shares_and_keeps_every_step_exact(job):
    check(job, "rebalanced")


def test_resumed_checkpoint_ends_as_the_uninterrupted_fit(job):
    check(job, "resumed")


@pytest.mark.parametrize("name", ["sharded_nothing", "several_roots", "outside_root"])
def test_setup_refuses_a_model_without_one_root_holding_every_parameter(job, name):
    check(job, name)


def test_only_data_parallelism_on_a_1d_mesh():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\).*use tensor_parallel_size=1"):
        HeteroModelParallelStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size=0\)"):
        HeteroModelParallelStrategy(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"HeteroModelParallelStrategy\(weighting='hook'\)"):
        HeteroModelParallelStrategy(weighting="hook")
