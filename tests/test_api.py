"""enable/disable, eval-mode behaviour, checkpoints, and clear refusals of what cannot be streamed exactly."""

import copy

import pytest
import torch
import transformers
from models import batch, tiny_model

from streambp_trl import disable_streambp, enable_streambp


def test_eval_and_no_grad_behave_as_before():
    reference = tiny_model("mistral")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, labels = batch(padding="left")
    for m in (reference, model):
        m.eval()
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=mask, labels=labels)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is not None and torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    gen_ref = reference.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=4, do_sample=False), gen_ref)


def test_training_no_grad_pass_streams_and_matches():
    """Reference-model style passes (train mode, no grad) run chunked and give the same log-probs."""
    reference = tiny_model("qwen3")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=3)
    ids, mask, labels = batch(padding="left")
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(2, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(out.log_probs, ref.masked_fill(labels[:, 1:] == -100, 0), rtol=1e-12, atol=1e-12)


def test_disable_restores_the_model():
    model = tiny_model("llama")
    before = type(model).forward, model.config._attn_implementation
    enable_streambp(model, stream_chunk_size=4)
    assert model.config._attn_implementation == before[1]  # switched only during streamed calls
    disable_streambp(model)
    assert "forward" not in vars(model) and model.config._attn_implementation == before[1]
    assert not any("_streambp_patches" in vars(m) or "forward" in vars(m) for m in model.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    ids, mask, labels = batch()
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is not None


def test_enable_twice_replaces_settings():
    model = tiny_model("llama")
    enable_streambp(model, stream_chunk_size=4)
    enable_streambp(model, stream_chunk_size=6)
    assert model._streambp.options.stream_chunk_size == 6
    disable_streambp(model)
    assert "forward" not in vars(model)


def test_checkpoint_loads_with_plain_transformers(tmp_path):
    model = enable_streambp(tiny_model("qwen3", dtype=torch.float32), stream_chunk_size=4)
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    model.save_pretrained(tmp_path)
    assert "streambp" not in (tmp_path / "config.json").read_text()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q), name
    loaded.generate(ids[:1], max_new_tokens=2)


@pytest.mark.parametrize("value", [0, -3, 2.5, "8", True])
def test_bad_chunk_size(value):
    with pytest.raises(ValueError, match="stream_chunk_size must be a positive integer"):
        enable_streambp(tiny_model("llama"), stream_chunk_size=value)
    with pytest.raises(ValueError, match="logits_chunk_size must be a positive integer"):
        enable_streambp(tiny_model("llama"), stream_chunk_size=4, logits_chunk_size=value or -1)


def test_bad_options():
    for name in ("stream_eval", "verify"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'yes'"):
            enable_streambp(tiny_model("llama"), stream_chunk_size=4, **{name: "yes"})
    with pytest.raises(ValueError, match="kv_mode"):
        enable_streambp(tiny_model("llama"), stream_chunk_size=4, kv_mode="offload")
    with pytest.raises(ValueError, match="fused_outputs"):
        enable_streambp(tiny_model("llama"), stream_chunk_size=4, fused_outputs=("logits",))


def test_all_labels_ignored_is_an_error():
    model = enable_streambp(tiny_model("llama"), stream_chunk_size=4)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="Every label is -100"):
        model(input_ids=ids, attention_mask=mask, labels=torch.full_like(ids, -100))
    # TRL's fused call keeps an all-masked micro-batch as a differentiable zero, as TRL's own head does
    out = model(input_ids=ids, attention_mask=mask, labels=torch.full_like(ids, -100), fused_lm_head=True)
    out.loss.backward()
    assert out.loss.item() == 0.0


@pytest.mark.parametrize(
    "family, overrides, match",
    [
        ("qwen3_moe", {"output_router_logits": True}, "Qwen3MoeForCausalLM .*load-balancing"),
        ("qwen3", {"is_causal": False}, "Qwen3ForCausalLM .*bidirectional"),
    ],
)
def test_refused_settings(family, overrides, match):
    with pytest.raises(ValueError, match=match):
        enable_streambp(tiny_model(family, **overrides), stream_chunk_size=4)


def test_attention_softcapping_streams_but_not_with_attention_dropout():
    """Softcapped attention runs through the engine's own kernel (exactness: tests/test_softcap.py), which has no
    attention dropout: that is refused when enabling, not at the first step."""
    config = transformers.Gemma2Config(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        attn_logit_softcapping=50.0,
    )
    enable_streambp(transformers.AutoModelForCausalLM.from_config(config), stream_chunk_size=4)
    config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="Gemma2ForCausalLM .*softcapped attention .*attention_dropout=0.0"):
        enable_streambp(transformers.AutoModelForCausalLM.from_config(config), stream_chunk_size=4)


def test_refuses_encoder_decoder():
    config = transformers.T5Config(vocab_size=50, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration .*encoder-decoder"):
        enable_streambp(transformers.T5ForConditionalGeneration(config), stream_chunk_size=4)


def test_refuses_non_transformers_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        enable_streambp(torch.nn.Linear(2, 2), stream_chunk_size=4)


class _CumulativeMix(torch.nn.Module):
    """Mixes each token with all earlier ones outside attention: what chunking cannot see."""

    def forward(self, x):
        return x + 0.1 * x.cumsum(dim=1)


def test_probe_refuses_token_mixing_outside_attention():
    model = tiny_model("llama")
    model.model.layers[0].mlp.act_fn = _CumulativeMix()
    with pytest.raises(ValueError, match="LlamaForCausalLM exactly: its layers give a different result when streamed"):
        enable_streambp(model, stream_chunk_size=4)
    assert "_streambp_patches" not in vars(model.model.layers[0]) and getattr(model, "_streambp", None) is None
    enable_streambp(model, stream_chunk_size=4, verify=False)  # the caller's responsibility then


def test_probe_refuses_a_head_that_is_not_linear_in_the_last_hidden_state():
    model = tiny_model("qwen3")
    model.lm_head.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM exactly: its logits are not a linear LM head"):
        enable_streambp(model, stream_chunk_size=4)


def test_probe_leaves_random_state_and_modes_as_they_were():
    model = tiny_model("llama", attention_dropout=0.1)
    model.model.layers[1].eval()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    enable_streambp(model, stream_chunk_size=4)
    assert torch.equal(torch.rand(3), expected)
    assert model.training and not model.model.layers[1].training and model.model.layers[0].training


def test_stream_eval_streams_reference_passes_in_eval_mode():
    """A frozen reference model (TRL keeps it in eval mode) streams its no-grad passes with stream_eval=True."""
    reference = tiny_model("qwen3").eval()
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=3, stream_eval=True)
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["hidden_states"].shape[1]), with_kwargs=True
    )
    ids, mask, labels = batch(padding="left")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        logits = reference(input_ids=ids, attention_mask=mask).logits
    assert calls == [3] * 7 + [2]  # chunk by chunk
    ref = torch.log_softmax(logits[:, :-1], -1).gather(2, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(out.log_probs, ref.masked_fill(labels[:, 1:] == -100, 0), rtol=1e-12, atol=1e-12)
    assert not model.training and not model.model.layers[0].training
    with torch.no_grad():  # generation in eval mode is the model's own
        assert torch.equal(model.generate(ids[:1], max_new_tokens=3), reference.generate(ids[:1], max_new_tokens=3))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_vision_language_models_own_forward_streams_its_decoder(mode):
    """``model(input_ids, attention_mask)`` without labels runs the model's own forward, whose decoder call streams
    (in training, or in eval with stream_eval): Gemma 3's vision-language model builds its masks before its language
    model, and got plain masks (``None`` where the padding is all ones), which no chunk can read. Those masks are the
    stream's too now; the logits equal the plain model's, chunk by chunk."""
    from model_support import Float64Internals
    from zoo import batch as zoo_batch
    from zoo import tiny_causal_lm

    reference = getattr(tiny_causal_lm("gemma3"), mode)()
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, stream_eval=True)
    calls = []
    model.model.language_model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["hidden_states"].shape[1]), with_kwargs=True
    )
    for padding in ("none", "left"):
        ids, mask, _ = zoo_batch(padding=padding)
        with torch.no_grad():
            logits, expected = (m(input_ids=ids, attention_mask=mask).logits for m in (model, reference))
        valid = mask.bool()
        torch.testing.assert_close(logits[valid], expected[valid], rtol=1e-10, atol=1e-10)
        if mode == "train":  # with grad: the gradient of the same function of the logits is plain autograd's (its
            grads = []  # norms' float32 arithmetic kept in float64, as the sweep does)
            for m in (model, reference):
                m.zero_grad()
                with Float64Internals():
                    (m(input_ids=ids, attention_mask=mask).logits[valid].square().mean()).backward()
                grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            assert grads[0].keys() == grads[1].keys()
            for n, g in grads[1].items():
                assert ((grads[0][n] - g).norm() / g.norm().clamp_min(1e-30)).item() < 1e-10, n
    assert set(calls) == {4, 3}  # 23 tokens in chunks of 4


def test_shipped_rewards():
    from streambp_trl.rewards import length_reward, sentence_format_reward

    assert length_reward(["x" * 40, "x" * 20, "x" * 200]) == [1.0, 0.5, -1.0]
    assert length_reward([[{"role": "assistant", "content": "x" * 40}]]) == [1.0]
    assert sentence_format_reward([" It is 4.", " It is 4. And 5.", "no period\nhere."]) == [1.0, 0.0, 0.0]


def _unstreamed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is not streamed" in r.getMessage()]


def test_a_sequence_within_one_chunk_is_said_once_naming_the_setting(caplog):
    """A call whose sequence fits one chunk streams nothing (each layer checkpointed whole): it was silent. The first
    such call with gradients says so, once, naming stream_chunk_size and max_length; no-grad calls and streamed ones
    say nothing."""
    model = enable_streambp(tiny_model("qwen3"), stream_chunk_size=16)
    ids = torch.randint(0, 100, (2, 24))
    with caplog.at_level("WARNING", logger="streambp_trl.engine.state"):
        with torch.no_grad():
            model(input_ids=ids[:, :8], labels=ids[:, :8])
        model(input_ids=ids, labels=ids).loss.backward()  # 24 > 16 tokens: streamed
        assert not _unstreamed(caplog)
        for length in (16, 8):
            model(input_ids=ids[:, :length], labels=ids[:, :length]).loss.backward()
    said = _unstreamed(caplog)
    assert said == [
        "StreamBP: a 16-token sequence is not streamed: it is no longer than stream_chunk_size=16; its decoder layers "
        "are checkpointed whole, which saves nothing over Hugging Face's checkpointing. To stream, set "
        "stream_chunk_size below 16, or train longer sequences (max_length). (Said once; later calls whose sequence "
        "fits one chunk are not streamed either.)"
    ]


def test_auto_choosing_one_chunk_is_said_naming_auto(caplog):
    model = enable_streambp(tiny_model("qwen3"), stream_chunk_size="auto")
    ids = torch.randint(0, 100, (1, 40))
    with caplog.at_level("WARNING", logger="streambp_trl.engine.state"):
        model(input_ids=ids, labels=ids).loss.backward()
    (said,) = _unstreamed(caplog)
    assert "a 40-token sequence is not streamed: stream_chunk_size='auto' chose one chunk of" in said
    assert "To stream, set stream_chunk_size to fewer than 40 tokens. (Said once" in said
