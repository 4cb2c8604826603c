"""Quantized base weights (QLoRA): bitsandbytes 4-bit (NF4, FP4, double quantization; float32 and bfloat16 compute)
and 8-bit base weights under LoRA and DoRA, streamed, against plain autograd on the same quantized model; the trainers
built the way TRL builds a QLoRA run, against TRL's own; the refusal of the quantization formats the engine has not
been tested on.

bitsandbytes' 4-bit layer, in eval mode on a CPU with AVX512-BF16, re-lays its weight for an inference kernel that has
no backward; the engine's probe runs the model in eval mode, so it did that to every layer and the LoRA gradients of
every layer went wrong (relative error about 1) while the loss stayed the same. The tests tell bitsandbytes that the
CPU has them (``has_avx512bf16``), so the re-laying path runs on any CPU, as it does on one that has the instructions.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MODEL, assert_same_training, tiny_dataset
from zoo import batch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback  # noqa: E402

from streambp_trl import enable_streambp  # noqa: E402

FLOAT32_BOUND = 1e-5  # float32 compute: the streamed loss and LoRA gradients against plain autograd, relative
# bfloat16 compute, against a float64 model holding the dequantized weights: as close as plain autograd, up to a
# factor 2 and one bfloat16 epsilon (see tests/test_bf16.py)
GRAD_SLACK = torch.finfo(torch.bfloat16).eps
LOSS_SLACK = 1e-4
FOUR_BIT = {
    "nf4": dict(bnb_4bit_quant_type="nf4"),
    "fp4_double_quant": dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    "nf4_double_quant": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
}


def _quantization(kind: str, compute: torch.dtype) -> BitsAndBytesConfig:
    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute, **FOUR_BIT[kind])


@pytest.fixture(autouse=True)
def relaying_on_every_cpu(monkeypatch):
    """Every 4-bit layer built in a test takes its eval-mode CPU re-laying path, as on a CPU with AVX512-BF16."""
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)


def qlora_model(kind: str = "nf4", compute: torch.dtype = torch.float32, dora: bool = False, prepare: bool = True):
    """The tiny checkpoint loaded with ``kind`` base weights, as TRL's ``--load_in_4bit`` loads them, prepared as PEFT
    prepares a k-bit model (``prepare_model_for_kbit_training`` unless ``prepare`` is off), LoRA (or DoRA) of
    rank 8 on every linear layer with random B (``init_lora_weights=False``: every gradient nonzero), in training
    mode; the same weights on every call."""
    model = AutoModelForCausalLM.from_pretrained(
        MODEL, quantization_config=_quantization(kind, compute), dtype=torch.float32
    )
    if prepare:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False, use_dora=dora)
    model = peft.get_peft_model(model, config)
    model.train()
    return model


def _loss_and_grads(model, ids, mask, labels) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    return loss.item(), grads


def _errors(reference: dict, candidate: dict) -> dict[str, float]:
    assert set(candidate) == set(reference)
    return {n: ((candidate[n] - g).norm() / g.norm()).item() for n, g in reference.items()}


CASES = [(kind, dora) for kind in (*FOUR_BIT, "int8") for dora in (False, True) if (kind, dora) != ("int8", True)]


@pytest.mark.parametrize(("kind", "dora"), CASES, ids=[f"{k}-{'dora' if d else 'lora'}" for k, d in CASES])
def test_quantized_base_float32_compute_equals_plain_autograd(kind, dora):
    """(DoRA on an 8-bit base: see the refusal's test below.)"""
    ids, mask, labels = batch(seq_len=29, padding="right")
    plain_loss, plain = _loss_and_grads(qlora_model(kind, dora=dora), ids, mask, labels)
    model = enable_streambp(qlora_model(kind, dora=dora), stream_chunk_size=8)
    loss, streamed = _loss_and_grads(model, ids, mask, labels)
    assert abs(loss - plain_loss) <= FLOAT32_BOUND * abs(plain_loss)
    worst = max(_errors(plain, streamed).items(), key=lambda kv: kv[1])
    assert worst[1] <= FLOAT32_BOUND, worst


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_base_with_torch_compile_runs_eager_and_says_so(kind, caplog):
    """QLoRA with torch_compile=True: bitsandbytes' kernels fail inside a compiled chunk (wrong fake shapes), so its
    layers run eagerly, with one warning saying why, and train as plain autograd does."""
    from torch._dynamo.utils import counters

    ids, mask, labels = batch(seq_len=29, padding="right")
    plain_loss, plain = _loss_and_grads(qlora_model(kind), ids, mask, labels)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    model = enable_streambp(qlora_model(kind), stream_chunk_size=8, torch_compile=True)
    loss, streamed = _loss_and_grads(model, ids, mask, labels)
    assert counters["stats"]["unique_graphs"] == before
    assert any("leaves the decoder layers eager" in r.getMessage() for r in caplog.records)
    assert abs(loss - plain_loss) <= FLOAT32_BOUND * abs(plain_loss)
    worst = max(_errors(plain, streamed).items(), key=lambda kv: kv[1])
    assert worst[1] <= FLOAT32_BOUND, worst


def test_probe_leaves_the_4bit_weights_as_they_were():
    """Enabling changes no weight: the 4-bit data (the same tensor) and its quantization state."""
    model = qlora_model("nf4_double_quant")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    before = [(m.weight.data, m.weight.data.clone(), dict(vars(m.weight.quant_state))) for m in layers]
    enable_streambp(model, stream_chunk_size=8)
    for m, (data, values, state) in zip(layers, before, strict=True):
        assert m.weight.data.data_ptr() == data.data_ptr() and torch.equal(m.weight.data, values)
        assert vars(m.weight.quant_state) == state
        assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False)


def _float64_twin(model) -> torch.nn.Module:
    """The same model in float64: every 4-bit base weight dequantized, every other weight (norms, embeddings, the
    adapters) cast."""
    reference = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64)
    reference = peft.get_peft_model(
        reference, peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    )
    weights = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            weights[f"{name}.weight"] = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
    for name, p in model.named_parameters():
        weights.setdefault(name, p.detach())
    for name, p in reference.named_parameters():
        with torch.no_grad():
            p.copy_(weights[name].double())
    reference.train()
    return reference


def test_4bit_bfloat16_compute_as_close_to_float64_as_plain_autograd():
    ids, mask, labels = batch(seq_len=29, padding="right")
    plain_model = qlora_model("nf4", torch.bfloat16)
    reference = _float64_twin(plain_model)
    ref_loss, ref = _loss_and_grads(reference, ids, mask, labels)
    plain_loss, plain = _loss_and_grads(plain_model, ids, mask, labels)
    loss, streamed = _loss_and_grads(
        enable_streambp(qlora_model("nf4", torch.bfloat16), stream_chunk_size=8), ids, mask, labels
    )
    assert abs(loss - ref_loss) <= 2 * abs(plain_loss - ref_loss) + LOSS_SLACK * abs(ref_loss)
    plain_errors, errors = _errors(ref, plain), _errors(ref, streamed)
    for name, err in errors.items():
        assert err <= 2 * plain_errors[name] + GRAD_SLACK, (name, err, plain_errors[name])


def test_8bit_dora_whose_own_eval_forward_fails_twice_is_refused_and_left_trainable():
    """DoRA on a bitsandbytes 8-bit base, on the CPU: the model's own second eval-mode forward fails (bitsandbytes
    and PEFT, without the engine), so the probe, which runs it in eval mode, refuses at enable with the model's own
    error; the model is left as it was, and trains plainly."""
    ids, mask, labels = batch(seq_len=11)
    plain = qlora_model("int8", dora=True).eval()
    with torch.no_grad():
        plain(input_ids=ids, attention_mask=mask)
        with pytest.raises(AttributeError):  # the upstream failure this refusal stands for
            plain(input_ids=ids, attention_mask=mask)
    model = qlora_model("int8", dora=True)
    with pytest.raises(ValueError, match="its own forward does not run"):
        enable_streambp(model, stream_chunk_size=8)
    _loss_and_grads(model, ids, mask, labels)


class _Marked(torch.Tensor):
    """A tensor subclass standing for a weight format the engine has not been tested on (torchao's quantized
    tensors are such subclasses)."""


def test_untested_quantization_formats_are_refused_by_name():
    from helpers import load_model

    model = load_model()
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match=r"quantized with gptq \(config.quantization_config.quant_method\)"):
        enable_streambp(model, stream_chunk_size=8)
    model = load_model()
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.weight = torch.nn.Parameter(q_proj.weight.detach().as_subclass(_Marked))
    with pytest.raises(ValueError, match=r"`model.layers.0.self_attn.q_proj.weight` is a .*_Marked"):
        enable_streambp(model, stream_chunk_size=8)
    model = load_model()
    model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(
        model.model.layers[1].mlp.up_proj.weight.detach().to(torch.float8_e4m3fn), requires_grad=False
    )
    with pytest.raises(ValueError, match=r"`model.layers.1.mlp.up_proj.weight` is of dtype torch.float8_e4m3fn"):
        enable_streambp(model, stream_chunk_size=8)


# -- the trainers, built the way TRL builds a QLoRA run: the model by name with BitsAndBytesConfig in
# model_init_kwargs (TRL's --load_in_4bit), a LoRA config on every linear layer (--use_peft). TRL then casts the
# adapters to bfloat16 (QLoRA's recipe), where chunked and whole-sequence matmuls round differently (2.7e-3 relative
# here); both trainers get them back in float32 before the first step (:class:`Float32Adapters`), so the comparison
# is float32's. (The bfloat16 forms are compared with a float64 reference above.)


class Float32Adapters(TrainerCallback):
    """The trainable parameters in float32 when training begins (the optimizer holds the same parameters)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()


def _qlora_run(**overrides) -> dict:
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    return dict(
        model=lambda: str(MODEL),
        peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),
        model_init_kwargs={"quantization_config": quantization, "dtype": torch.float32},
        learning_rate=0.5,
        callbacks=(Float32Adapters(),),
        **overrides,
    )


def test_qlora_sft_step_equals_trl(tmp_path):
    from trl import SFTConfig, SFTTrainer

    from streambp_trl import StreamSFTConfig, StreamSFTTrainer

    _, ours = assert_same_training(
        (SFTTrainer, SFTConfig), (StreamSFTTrainer, StreamSFTConfig), tmp_path, tiny_dataset("chat"), **_qlora_run()
    )
    assert getattr(ours.model, "is_loaded_in_4bit", False)


def test_qlora_dpo_step_equals_trl(tmp_path):
    """The reference model is the policy with its adapter disabled (TRL's way under PEFT)."""
    from trl import DPOConfig, DPOTrainer

    from streambp_trl import StreamDPOConfig, StreamDPOTrainer

    assert_same_training(
        (DPOTrainer, DPOConfig),
        (StreamDPOTrainer, StreamDPOConfig),
        tmp_path,
        tiny_dataset("preference", 8),
        **_qlora_run(beta=0.1),
    )


def test_qlora_grpo_step_equals_trl(tmp_path, monkeypatch):
    """Generation runs the policy in eval mode without grad, which re-lays the 4-bit weights on a CPU with
    AVX512-BF16 in TRL's own run too (bitsandbytes, without the engine; no gradient then reaches the layers' inputs):
    this test runs bitsandbytes' plain CPU path."""
    from helpers import LengthReward
    from trl import GRPOConfig, GRPOTrainer

    from streambp_trl import StreamGRPOConfig, StreamGRPOTrainer

    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: False)
    dataset = tiny_dataset("prompt_completion", 8).remove_columns("completion")
    rl = dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=8, temperature=0.7, beta=0.04)
    trl_trainer, ours = assert_same_training(
        (GRPOTrainer, GRPOConfig),
        (StreamGRPOTrainer, StreamGRPOConfig),
        tmp_path,
        dataset,
        rewards=lambda: [LengthReward()],
        **_qlora_run(**rl),
    )
    assert ours.reward_funcs[0].seen == trl_trainer.reward_funcs[0].seen


@pytest.mark.slow
def test_cli_trains_qlora_and_saves_an_adapter_plain_peft_loads(tmp_path):
    """TRL's flags for QLoRA (``--load_in_4bit --use_peft``) on the tiny config: it trains, streamed, and saves the
    adapter, which PEFT loads onto the plain base model."""
    import subprocess
    import sys

    from helpers import ROOT

    out = subprocess.run(
        [sys.executable, "-m", "streambp_trl.cli", "sft", "--config", "configs/sft_tiny.yaml", "--load_in_4bit",
         "true", "--use_peft", "true", "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'stream_chunk_size': 32" in out.stdout + out.stderr
    model = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path)
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and any(p.abs().sum() > 0 for p in trained)  # LoRA's B starts at zero: it trained


def test_bfloat16_adapters_over_many_chunks_as_close_to_float64_as_plain_autograd():
    """TRL's QLoRA adapters are bfloat16: 32 chunks of gradient summed in bfloat16 would round at every chunk (LoRA
    gradients up to 2.06x as far from float64 as plain autograd's here); summed in float32 and rounded once, as the
    plain backward rounds its total, each stays within 1.25x of plain autograd's error."""

    def bf16_adapters(model):
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
        return model

    ids, mask, labels = batch(batch_size=1, seq_len=256, padding="none")
    plain_model = bf16_adapters(qlora_model("nf4", torch.bfloat16))
    _, ref = _loss_and_grads(_float64_twin(plain_model), ids, mask, labels)
    _, plain = _loss_and_grads(plain_model, ids, mask, labels)
    streamed_model = enable_streambp(bf16_adapters(qlora_model("nf4", torch.bfloat16)), stream_chunk_size=8)
    _, streamed = _loss_and_grads(streamed_model, ids, mask, labels)
    plain_errors, errors = _errors(ref, plain), _errors(ref, streamed)
    worst = max(errors, key=lambda name: errors[name] / plain_errors[name])
    assert errors[worst] <= 1.25 * plain_errors[worst], (worst, errors[worst], plain_errors[worst])


def test_integer_and_boolean_parameters_are_served():
    """A frozen integer or boolean parameter (a mask, an index table) carries no gradient: not a weight format to
    refuse."""
    from helpers import load_model

    model = load_model()
    layer = model.model.layers[0]
    layer.register_parameter("kept", torch.nn.Parameter(torch.ones(4, dtype=torch.bool), requires_grad=False))
    layer.register_parameter("index", torch.nn.Parameter(torch.arange(4), requires_grad=False))
    enable_streambp(model, stream_chunk_size=8)
