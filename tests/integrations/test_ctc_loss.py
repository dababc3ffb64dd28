"""A transformers speech model with a CTC loss (Wav2Vec2ForCTC), as shipped, sizes shrunk: under plain
torch.compile the loss runs eagerly after the compiled region, and its backward exponentiates the
log-space values it saved. ``sh.policy()`` keeps what the CTC loss saves and holds 25 dB."""

from __future__ import annotations

import pytest
import torch

import savedhooks as sh
from tests.models import POLICY_DB

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(32, 32),
    conv_stride=(5, 2), conv_kernel=(10, 3), conv_bias=False, num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2, vocab_size=32, pad_token_id=0, mask_time_prob=0.0, layerdrop=0.0,
    ctc_loss_reduction="mean", hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    feat_proj_dropout=0.0, final_dropout=0.0,
)  # fmt: skip


def _case():
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**CONFIG)).train()
    inputs = {"input_values": torch.randn(2, 4000), "labels": torch.randint(1, 32, (2, 12))}
    return model, inputs


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_policy_keeps_a_ctc_loss_s_saved_tensors_and_its_gradients(backend):
    model, inputs = _case()
    try:
        torch._dynamo.reset()
        result = sh.fidelity.check(model, inputs, sh.policy(), backend=backend, device="cpu")
    finally:
        torch._dynamo.reset()
    assert result.ok and result.worst_db >= POLICY_DB, str(result)
    assert result.peak_ratio < 1.0, str(result)  # the encoder's activations are still packed


def test_downcast_alone_is_unsafe_on_a_ctc_loss():
    """sh.downcast(bf16) casts everything, the CTC loss's log-space values included (docs/fidelity.md)."""
    model, inputs = _case()
    result = sh.fidelity.check(model, inputs, sh.downcast(torch.bfloat16), backend=None, device="cpu")
    assert not result.ok, str(result)
