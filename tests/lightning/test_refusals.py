"""The refusals outside a step: PyTorch's error for a gradient view changed in grad mode, explained where a hook
before the optimizer step raised it (the whole path, on 2 ranks, is ``tests/exact`` cases
``grad-changed-in-grad-mode-*``; the uneven ``all_gather`` is case ``all-gather-uneven``; the refused callbacks cases
``swa``, ``ema``, ``averaged-model-in-init``, ``lr-finder``)."""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.lightning.refusals import explain_grad_view_error, refuse_encoder_decoders


def _after_closure() -> None:  # named as Lightning's function that runs the hooks before the optimizer step
    p = torch.nn.Parameter(torch.ones(4))
    flat = torch.zeros(8)
    with torch.no_grad():
        p.grad = flat[:4]  # a view made in no-grad mode, as the strategy's gradients are
    p.grad.add_(p)  # grad mode: PyTorch refuses


def test_a_hook_changing_a_gradient_view_in_grad_mode_is_told_the_fix() -> None:
    with pytest.raises(RuntimeError) as caught:
        _after_closure()
    with pytest.raises(RuntimeError, match=r"torch.no_grad\(\).*weight_decay") as told:
        explain_grad_view_error(caught.value)
    assert told.value.__cause__ is caught.value


def test_the_same_error_elsewhere_is_left_as_it_is() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(RuntimeError) as caught:
        p.add_(1.0)  # a leaf that requires grad changed in place, in the step itself
    explain_grad_view_error(caught.value)  # returns: not a hook's


def test_an_encoder_decoder_is_refused_frozen_or_not_and_its_halves_left() -> None:
    """``nn.Transformer`` and a module holding an encoder and a decoder whose ``config.is_encoder_decoder`` is true are
    refused, frozen too (a frozen one's decoder would read this rank's slice of the encoder's output); an encoder or a
    decoder alone is left (Hugging Face's models through Lightning: ``tests/exact`` ``hf-bart*``, ``hf-t5``)."""
    import transformers

    model = torch.nn.Module()
    model.seq2seq = torch.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1)
    with pytest.raises(ValueError, match=r"Module\.seq2seq is an encoder-decoder \(Transformer\)"):
        refuse_encoder_decoders(model)
    model.seq2seq.requires_grad_(False)
    with pytest.raises(ValueError, match="is an encoder-decoder"):
        refuse_encoder_decoders(model)
    refuse_encoder_decoders(model.seq2seq.encoder)  # its halves alone
    refuse_encoder_decoders(model.seq2seq.decoder)

    config = transformers.BartConfig(
        vocab_size=32, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32,
    )  # fmt: skip
    bart = transformers.BartModel(config)
    with pytest.raises(ValueError, match=r"^BartModel is an encoder-decoder \(BartModel\)"):
        refuse_encoder_decoders(bart)
    refuse_encoder_decoders(bart.get_encoder())  # is_encoder_decoder in its config, but no decoder
    refuse_encoder_decoders(bart.get_decoder())
