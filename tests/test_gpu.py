"""The CUDA paths on a real GPU, mixed with the CPU: run where a GPU exists (marked `gpu`), skipped elsewhere."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_grads, mlp
from torch import nn
from torch.utils.checkpoint import checkpoint

import hetsplit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _net():
    return mlp(6, 16, 4)


def _assert_grads(model, ref):
    # The reference runs on the CPU, the replicas partly on the GPU: cuBLAS and the CPU's
    # BLAS round float64 differently (~1e-9 relative after a few layers), while a weighting
    # error shows at 1e-2 and more. So: 1e-7 of the largest gradient.
    assert_same_grads(model, ref, rtol=1e-7)


@pytest.mark.parametrize("home", ["cuda:0", "cpu"])
@pytest.mark.parametrize("mode", ["gather", "local"])
def test_gpu_and_cpu_together_give_the_full_batch_gradient(home, mode):
    model = _net().to(home)
    ref = copy.deepcopy(model).cpu()
    x, y = torch.randn(40, 6, dtype=torch.float64), torch.randint(0, 4, (40,))
    dp = hetsplit.HeteroDataParallel(model, ["cuda:0", "cpu"], weights=[3, 1])
    if mode == "gather":
        out = dp(x.to(home))
        assert out.device == torch.device(home)
        F.cross_entropy(out, y.to(home)).backward()
    else:
        dp.train_step(x, y, F.cross_entropy)
    F.cross_entropy(ref(x), y).backward()
    _assert_grads(model, ref)
    assert dp.plan.sizes == [30, 10] and set(dp.step_times) == {"cuda:0", "cpu"}


def test_batchnorm_and_checkpointing_across_gpu_and_cpu():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

        def forward(self, x):
            h = checkpoint(lambda t: torch.tanh(self.bn(self.a(t))), x, use_reentrant=False)
            return self.b(h)

    torch.manual_seed(0)
    model = Net().double().cuda()
    x = torch.randn(16, 5, dtype=torch.float64)
    shards = [x[:12], x[12:]]
    ref = copy.deepcopy(model).cpu()
    torch.cat([ref(s) for s in shards]).pow(2).sum().backward()  # BatchNorm: each shard on its own
    dp = hetsplit.HeteroDataParallel(model, ["cuda:0", "cpu"], weights=[3, 1])
    dp(x.cuda()).pow(2).sum().backward()
    _assert_grads(model, ref)
    assert int(model.bn.num_batches_tracked) == 1


def test_module_moves_between_gpu_and_cpu_and_round_trips():
    model = _net()
    dp = hetsplit.HeteroDataParallel(model, ["cuda:0", "cpu"], weights=[1, 1])
    x = torch.randn(8, 6, dtype=torch.float64)
    cpu_out = dp(x)
    dp.cuda()
    gpu_out = dp(x.cuda())
    assert gpu_out.device.type == "cuda"
    torch.testing.assert_close(gpu_out.cpu(), cpu_out, rtol=1e-12, atol=1e-12)
    plain = _net()
    plain.load_state_dict({k: v.cpu() for k, v in dp.state_dict().items()})


def test_gpt2_padded_loss_on_gpu_and_cpu():
    import transformers

    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double().cuda()
    ref = copy.deepcopy(model).cpu()
    ids = torch.randint(1, 100, (8, 10))
    labels = ids.clone()
    labels[0, 3:] = -100
    labels[6, 2:] = -100
    dp = hetsplit.HeteroDataParallel(model, ["cuda:0", "cpu"], weights=[3, 1],
                                     scalar_outputs=hetsplit.count_tokens("labels"))  # fmt: skip
    out = dp(input_ids=ids.cuda(), labels=labels.cuda(), use_cache=False)
    expected = ref(input_ids=ids, labels=labels, use_cache=False)
    torch.testing.assert_close(out.loss.cpu(), expected.loss, rtol=1e-10, atol=0)
    out.loss.backward()
    expected.loss.backward()
    _assert_grads(model, ref)


def test_profile_measures_peak_memory_and_fits_the_memory_model():
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    prof = hetsplit.profile(
        model, torch.randn(8, 256), ["cuda:0"], batch_sizes=[8, 64, 512], repeats=1, time_budget=20, progress=False
    )
    mem = prof.entries[0].memory
    # The ladder's peaks, then those of the memory probe (it doubles past the ladder until out
    # of memory or max_probe: on an H200 up to 65,536 samples of this model).
    sizes = [b for b, _ in mem.peaks] if mem is not None else []
    assert sizes[:3] == [8, 64, 512] and sizes == sorted(set(sizes)), sizes
    assert mem.per_sample > 0 and mem(512) >= mem(8)
    assert hetsplit.Profile.from_dict(prof.to_dict()).entries[0].memory == mem
