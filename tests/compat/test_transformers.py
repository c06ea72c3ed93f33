"""Hugging Face models built from configs (never downloaded): losses computed inside the model, padding, caches."""

import copy

import pytest
import torch
import transformers
from compat_helpers import round_trips, train_lowers_loss, wrap
from helpers import assert_same_grads, max_rel_grad_error

import hetsplit

transformers.logging.set_verbosity_error()


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg).double()


def _gpt2():
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).double()


def _bert_batch(n=8):
    ids = torch.randint(1, 100, (n, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # some padding (synthetic tokens)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (n,))}


def _gpt2_batch(n=8):
    ids = torch.randint(1, 100, (n, 10))
    labels = ids.clone()
    # Padded tails of different lengths: the shards hold different numbers of real tokens.
    for row, keep in ((0, 3), (1, 9), (2, 5), (5, 2), (6, 2), (7, 4)):
        labels[row, keep:] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bert_loss_is_the_full_batch_loss(checkpointing):
    model = _bert()
    if checkpointing:
        model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model)
    batch = _bert_batch()
    out = wrap(model)(**batch)
    expected = ref(**batch)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    expected.loss.backward()
    assert_same_grads(model, ref)


def test_the_stacked_mean_nn_data_parallel_gives_is_biased_on_uneven_shards():
    model = _bert()
    ref = copy.deepcopy(model)
    batch = _bert_batch()
    stacked = wrap(model, scalar_outputs="stack")(**batch).loss
    assert stacked.shape == (2,)  # one per replica, as nn.DataParallel returns
    stacked.mean().backward()  # the usual fix-up: each of 6 and 2 samples' shards weighs half
    ref(**batch).loss.backward()
    assert max_rel_grad_error(model, ref, per_parameter=False) > 0.05


def test_gpt2_padded_token_loss_weighted_by_token_count():
    model = _gpt2()
    ref = copy.deepcopy(model)
    batch = _gpt2_batch()
    out = wrap(model, scalar_outputs=hetsplit.count_tokens("labels"))(**batch, use_cache=False)
    expected = ref(**batch, use_cache=False)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-12, atol=0)
    out.loss.backward()
    expected.loss.backward()
    assert_same_grads(model, ref)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tied embedding stayed tied
    # Weighting by samples instead is wrong here: the shards hold 6 and 2 rows but other token counts.
    plain = copy.deepcopy(ref)
    plain.zero_grad()
    wrap(plain)(**batch, use_cache=False).loss.backward()
    assert max_rel_grad_error(plain, ref, per_parameter=False) > 0.05


def test_gpt2_with_checkpointing_and_a_cache():
    model = _gpt2()
    model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model)
    batch = _gpt2_batch()
    dp = wrap(model, scalar_outputs=hetsplit.count_tokens("labels"))
    out = dp(**batch)
    expected = ref(**batch)
    out.loss.backward()
    expected.loss.backward()
    assert_same_grads(model, ref)
    cache = out.get("past_key_values")
    if cache is not None:  # a cache object is not split or concatenated: one per replica, never replica 0's alone
        assert isinstance(cache, list) and len(cache) == 2


def test_gpt2_trains_and_round_trips():
    model = _gpt2()
    batch = _gpt2_batch()
    dp = wrap(model, scalar_outputs=hetsplit.count_tokens("labels"))
    first, last = train_lowers_loss(dp, lambda m: m(**batch, use_cache=False).loss, lr=0.5)
    assert last < first
    round_trips(dp, lambda m: m(**batch, use_cache=False).logits)


def test_train_step_with_keyword_inputs_and_a_model_loss():
    model = _bert()
    ref = copy.deepcopy(model)
    batch = _bert_batch()
    dp = wrap(model)
    loss = dp.train_step(batch, loss_fn=lambda out: out.loss)
    expected = ref(**batch).loss
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    expected.backward()
    assert_same_grads(model, ref)
