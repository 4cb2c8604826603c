"""The engine stays installed and exact through what TRL, transformers, PEFT and users do to a model."""

import copy
import warnings

import pytest
import torch
from helpers import EXACT, assert_matches_plain, max_rel_grad_error, reference_loss
from models import VOCAB, batch, tiny_model
from trl.models.utils import disable_gradient_checkpointing

from streambp_trl import disable_streambp, enable_streambp
from streambp_trl.engine import is_streaming
from streambp_trl.layers.layer_args import cache_argument


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' gradient_checkpointing_* deprecation
        return fn(*args, **kwargs)


def test_streaming_survives_transformers_checkpointing_switches():
    reference = tiny_model("qwen3")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    _quiet(model.gradient_checkpointing_enable)
    assert is_streaming(model)
    _quiet(model.gradient_checkpointing_disable)
    assert is_streaming(model)
    model.activation_checkpointing_enable(every_n_layers=2)
    assert is_streaming(model)
    assert_matches_plain(reference, model, *batch(padding="left"))
    # what transformers asked for last is what disable_streambp leaves behind
    disable_streambp(model)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]


def test_streaming_survives_trl_reference_pass_context():
    reference = tiny_model("qwen3")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    _quiet(model.gradient_checkpointing_enable)
    ids, mask, labels = batch(padding="left")
    for _ in range(2):  # TRL wraps every reference / old-policy pass like this, step after step
        with _quiet(disable_gradient_checkpointing, model), torch.no_grad():
            assert is_streaming(model)
            model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        assert is_streaming(model)
    assert_matches_plain(reference, model, ids, mask, labels)


def test_deepcopy_streams_and_runs_in_both_modes():
    reference = tiny_model("mistral")
    original = enable_streambp(tiny_model("mistral"), stream_chunk_size=4)
    model = copy.deepcopy(original)
    assert is_streaming(model) and model.model.layers[0]._gradient_checkpointing_func.func
    assert model.forward.__self__ is model and model.model.forward.__self__ is model.model
    ids, mask, labels = batch(padding="left")
    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, reference(ids, mask).logits)
    model.train()
    reference.train()
    assert_matches_plain(reference, model, ids, mask, labels)
    disable_streambp(model)
    assert is_streaming(original) and not is_streaming(model)


def test_models_sharing_a_config_do_not_disturb_each_other():
    a = tiny_model("llama")
    b = type(a)(a.config).to(torch.float64).train()
    b.load_state_dict(a.state_dict())
    reference = copy.deepcopy(a)
    enable_streambp(a, stream_chunk_size=4)
    enable_streambp(b, stream_chunk_size=4)
    disable_streambp(a)
    assert is_streaming(b) and not is_streaming(a)
    ids, mask, labels = batch(padding="left")
    assert a(input_ids=ids, attention_mask=mask, labels=labels).logits is not None  # plain transformers again
    assert_matches_plain(reference, b, ids, mask, labels)


def test_save_and_reload_keep_the_engine(tmp_path):
    model = enable_streambp(tiny_model("qwen3", dtype=torch.float32), stream_chunk_size=4)
    model.save_pretrained(tmp_path)
    assert "streambp" not in (tmp_path / "config.json").read_text()
    model.load_state_dict(type(model).from_pretrained(tmp_path).state_dict())
    assert is_streaming(model)


def test_generation_in_training_mode_matches_eval():
    """TRL generates (GRPO, RLOO) with the policy in training mode: the cache must be filled as usual."""
    reference = tiny_model("qwen3").eval()
    model = enable_streambp(copy.deepcopy(reference).train(), stream_chunk_size=4)
    ids = batch()[0][:1]
    expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)
    assert is_streaming(model)


def test_cache_queries_answer_for_the_prefix():
    """A layer asking its cache how many tokens came before gets the chunk's start, as a real cache would answer."""
    model = enable_streambp(tiny_model("llama"), stream_chunk_size=5)
    seen = []
    model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.append((cache_argument(kw).get_seq_length(), kw["hidden_states"].shape[1])),
        with_kwargs=True,
    )
    ids, mask, labels = batch(seq_len=23)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    forward = seen[:5]
    assert forward == [(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]


def test_return_dict_false_and_hidden_states():
    reference = tiny_model("qwen3")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, labels = batch(padding="left")
    (loss,) = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert abs(loss.item() - reference_loss(reference, ids, mask, labels).item()) < 1e-12
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    ref = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    for h, r in zip(out.hidden_states, ref.hidden_states, strict=True):
        torch.testing.assert_close(h, r, rtol=1e-12, atol=1e-12)


def test_output_attentions_is_refused_in_training():
    model = enable_streambp(tiny_model("qwen3"), stream_chunk_size=4)
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match="output_attentions=True is not available"):
        model(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True)


@pytest.mark.parametrize("bad", [-1, VOCAB])
@pytest.mark.parametrize("fused", [False, True])
def test_out_of_range_labels_raise(bad, fused):
    model = enable_streambp(tiny_model("qwen3"), stream_chunk_size=4)
    ids, mask, labels = batch()
    labels[0, 10] = bad
    with pytest.raises(ValueError, match=rf"labels must be token ids in \[0, {VOCAB}\) or -100 .*got {bad}"):
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=fused)


def test_lora_with_lm_head_in_modules_to_save():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], lora_dropout=0.0)
    reference = peft.get_peft_model(tiny_model("qwen3"), config)
    for name, p in reference.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    assert_matches_plain(reference, streamed, *batch(padding="left"))
    assert any("modules_to_save" in n and p.grad is not None for n, p in streamed.named_parameters())
    with streamed.disable_adapter():  # the reference pass of DPO with PEFT: the original head is used
        out = streamed(*batch()[:2], labels=batch()[2], fused_lm_head=True)
        ref = reference.get_base_model()(*batch()[:2])
    assert torch.isfinite(out.loss) and ref.logits is not None


def test_lora_on_the_lm_head_is_refused_at_enable():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM exactly: its LM head is a peft.tuners.lora.layer.Linear"):
        enable_streambp(model, stream_chunk_size=4)


def test_gradients_of_a_reenabled_model_are_exact():
    reference = tiny_model("olmo2")
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=3)
    disable_streambp(model)
    enable_streambp(model, stream_chunk_size=5)
    err = assert_matches_plain(reference, model, *batch(padding="right"))
    assert err < EXACT and max_rel_grad_error(reference, model)[0] < EXACT
