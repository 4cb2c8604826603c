"""What a real step holds, as the memory model and ``streambp-trl max-len`` count it: the optimizer state of
``TrainingArguments.optim`` in the trained parameters' dtype (against the optimizers' own allocations), quantized base
weights at their stored size (against bitsandbytes' own), TRL's default optimizer by default, QLoRA, and what fits
instead where a recipe fits at no length. No network: named shapes and the tiny checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import MODEL
from transformers import AutoConfig
from transformers.training_args import OptimizerNames

from streambp_trl import cli
from streambp_trl.bench import max_len as ml
from streambp_trl.bench import plans
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing import optimizers

GiB = 2**30
QWEN3_8B = mm.ModelShape.from_name("qwen3-8b")


def test_optimizer_names_are_training_arguments_optim_names():
    assert set(optimizers.OPTIMIZERS) - {"none"} <= {name.value for name in OptimizerNames}
    assert optimizers.DEFAULT == "adamw_torch_fused"
    assert optimizers.canonical("adamw") == "adamw_torch_fused" and optimizers.canonical("adamw-8bit") == "adamw_8bit"
    assert optimizers.canonical(OptimizerNames.PAGED_ADAMW_8BIT) == "paged_adamw_8bit"
    with pytest.raises(ValueError, match="not sized"):
        optimizers.canonical("galore_adamw")


def _allocated_state(optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for t in state.values():
            if torch.is_tensor(t) and t.dim() > 0 and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _optimizer(name: str, params):
    if name in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "adamw_8bit":
        bnb = pytest.importorskip("bitsandbytes")
        return bnb.optim.AdamW8bit(params, lr=1e-3)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
    return {"adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop, "sgd": torch.optim.SGD}[name](
        params, lr=1e-3
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["adamw_torch", "adamw_8bit", "adafactor", "adagrad", "rmsprop", "sgd"])
def test_state_bytes_are_what_the_optimizer_allocates(name, dtype):
    """Before its first step the rule predicts, per parameter dtype and shape, what the optimizer then allocates
    (AdamW: two zeros_like moments, so 4 bytes an element for bfloat16 and 8 for float32, not a flat 8); after it,
    the allocation is counted as it is and nothing is pending."""
    if name == "adamw_8bit" and dtype is torch.bfloat16:
        pytest.skip("bitsandbytes' CPU 8-bit optimizer takes float32 parameters")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 32, bias=False)).to(dtype)
    predicted, pending = optimizers.state_bytes(model.parameters(), name)  # no optimizer yet: all of it pending
    assert predicted == pending
    optimizer = _optimizer(name, model.parameters())  # (Adagrad allocates its state here, the others at step())
    assert optimizers.state_bytes(model.parameters(), name, optimizer) == (
        predicted,
        0 if name == "adagrad" else predicted,
    )
    model(torch.randn(3, 256, dtype=dtype)).sum().backward()
    optimizer.step()
    allocated = _allocated_state(optimizer)
    maps = 2 * 256 * 4 if name == "adamw_8bit" else 0  # bitsandbytes' two shared quantization maps
    assert predicted + maps == allocated
    assert optimizers.state_bytes(model.parameters(), name, optimizer) == (allocated, 0)
    if name == "adamw_torch":
        assert predicted == 2 * sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8


def test_static_bytes_count_the_state_in_the_trained_dtype():
    shape, lora = QWEN3_8B, mm.StepSetup(lora=True)
    adapters = mm.trained_params(shape, lora)
    for setup, state in [
        (mm.StepSetup(optimizer="adamw"), 4 * shape.params),  # bfloat16 weights: two bfloat16 moments
        (mm.StepSetup(optimizer="adamw", dtype_bytes=4), 8 * shape.params),
        (mm.StepSetup(optimizer="adamw", lora=True), 8 * adapters),  # PEFT's float32 adapters
        (mm.StepSetup(optimizer="adamw", lora=True, quantized="4bit"), 4 * adapters),  # TRL's bfloat16 adapters
        (mm.StepSetup(optimizer="adamw_8bit"), math.ceil((2 + 8 / 256) * shape.params)),
        (mm.StepSetup(optimizer="adamw", optimizer_offload=True), 0),
        (mm.StepSetup(optimizer="sgd"), 0),
    ]:
        assert mm.optimizer_bytes(shape, setup) == state, setup
    factored = mm.optimizer_bytes(shape, mm.StepSetup(optimizer="adafactor"))
    assert 0 < factored < shape.params / 64  # rows and columns: small


def test_the_optimizer_step_is_a_floor_of_the_peak():
    """torch's foreach AdamW (``adamw_torch``) allocates sqrt(exp_avg_sq) of every parameter inside step(), beside
    every gradient: a floor no length goes below; the fused default does not."""
    shape = QWEN3_8B
    fused, foreach = (
        mm.StepSetup(optimizer=name, pending_grads=True) for name in ("adamw_torch_fused", "adamw_torch")
    )
    assert mm.optimizer_step_bytes(shape, foreach) - mm.optimizer_step_bytes(shape, fused) == 2 * shape.params
    assert mm.estimate_peak_bytes(shape, foreach, 1024) == mm.optimizer_step_bytes(shape, foreach)
    assert mm.estimate_peak_bytes(shape, fused, 1024) > mm.optimizer_step_bytes(shape, fused)


def _stored_bytes(model) -> int:
    """A bitsandbytes model's weights as stored: its parameters and each quantized weight's scales."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            if state.nested:
                total += state.state2.absmax.numel() * state.state2.absmax.element_size()
        scales = getattr(weight, "SCB", None)
        if scales is not None:
            total += scales.numel() * scales.element_size()
    return total


@pytest.mark.parametrize(
    "kind, config",
    [
        ("4bit", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4")),
        ("4bit-nested", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True)),
        ("8bit", dict(load_in_8bit=True)),
    ],
)
def test_quantized_weights_are_counted_at_their_stored_size(kind, config):
    """The tiny checkpoint loaded through transformers' BitsAndBytesConfig holds what the memory model counts for its
    weights (less the dequantized weight, a transient), within its norms' share (counted as quantized)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(**config, bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(MODEL, quantization_config=quantization, dtype=torch.float32)
    shape = mm.ModelShape.from_config(AutoConfig.from_pretrained(MODEL))
    setup = mm.StepSetup(lora=True, quantized=kind, dtype_bytes=4)
    counted = mm.weight_bytes(shape, setup) - mm.dequantized_bytes(shape, setup)
    stored = _stored_bytes(model)
    assert abs(counted - stored) <= 0.01 * stored, (counted, stored)
    full = shape.params * 4
    assert stored < 0.6 * full  # (the tiny model's embedding is a third of it)


def _estimate(argv: list[str], monkeypatch, capsys, host: int = 100 * GiB) -> tuple[dict, str]:
    monkeypatch.setattr(plans, "host_room", lambda: host)
    result = ml.main(["--model", "qwen3-8b", "--gpu", "h100", *argv])
    return result, capsys.readouterr().out


def _row(result: dict, mode: str) -> int:
    return next(row["max_len"] for row in result["rows"] if row["mode"] == mode)


def test_max_len_counts_trls_default_optimizer_by_default(monkeypatch, capsys):
    """No --optimizer: AdamW (transformers' adamw_torch_fused), whose bfloat16 moments a full fine-tuning of Qwen3-8B
    holds beside its weights and gradients; --optimizer none is the forward+backward alone."""
    default, out = _estimate(["--mode", "stream"], monkeypatch, capsys)
    assert "adamw_torch_fused state held" in out.splitlines()[0]
    alone, out = _estimate(["--mode", "stream", "--optimizer", "none"], monkeypatch, capsys)
    assert "no optimizer state" in out.splitlines()[0]
    setup = mm.StepSetup(optimizer="adamw_torch_fused", pending_grads=True)
    assert _row(default, "stream") == plans.stream_row(QWEN3_8B, setup, 78 * GiB, 0, False)["max_len"]
    assert _row(default, "stream") < _row(alone, "stream")
    lora, _ = _estimate(["--mode", "stream", "--lora"], monkeypatch, capsys)
    lora_alone, _ = _estimate(["--mode", "stream", "--lora", "--optim", "none"], monkeypatch, capsys)
    assert _row(lora, "stream") < _row(lora_alone, "stream")  # the adapters' AdamW state


def test_qlora_reaches_past_342k_on_an_80gb_card_and_past_1m_with_100gib_of_host_memory(monkeypatch, capsys):
    """The issue's acceptance: Qwen3-8B QLoRA (NF4 base, r 16 on every linear layer, the adapters' AdamW state) on
    an 80 GB card, estimated by max-len: past 342k tokens without offload (the plan keeping every k-th input) and past
    a million with offload within 100 GiB of pinned host memory; further than LoRA on a bfloat16 base."""
    qlora, out = _estimate(["--load-in-4bit"], monkeypatch, capsys)
    assert "(QLoRA (4-bit base))" in out.splitlines()[0]
    lora, _ = _estimate(["--lora"], monkeypatch, capsys)
    assert _row(qlora, "stream") > _row(lora, "stream") and _row(qlora, "trl-default") > _row(lora, "trl-default")
    longest = qlora["plans"]["longest"]
    without = max(tokens for way, tokens in longest.items() if "offload" not in way)
    with_offload = max(tokens for way, tokens in longest.items() if "offload" in way)
    assert without > 342_000 and with_offload > 1_000_000
    assert (_row(qlora, "stream"), _row(qlora, "stream+offload")) == (without, with_offload)  # the rows say the same
    assert qlora["plans"]["host_bytes"] == 100 * GiB
    assert any(row["tokens"] >= 1 << 20 and row["offload"] for row in qlora["plans"]["rows"])
    setups = {s.quantized for s in (ml.row_setup(m, ml.build_parser().parse_args(["--model", "x", "--load-in-4bit"]))
                                    for m in ml.ROWS)}  # fmt: skip
    assert setups == {"4bit"}


def test_qlora_names_read_as_trls_flags():
    parse = ml.build_parser().parse_args
    args = parse(["--model", "x", "--load_in_4bit", "--use_bnb_nested_quant", "--optim", "paged_adamw_8bit"])
    setup = ml.row_setup("stream", args)
    assert (setup.lora, setup.quantized, setup.optimizer) == (True, "4bit-nested", "paged_adamw_8bit")
    assert ml.row_setup("stream", parse(["--model", "x", "--use_peft"])).lora


def test_quantized_weights_are_estimated_only(capsys):
    with pytest.raises(SystemExit):
        cli.main(["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "40MiB", "--load-in-4bit"])
    assert "estimated only" in capsys.readouterr().err


def test_a_recipe_that_fits_at_no_length_names_what_fits_instead(monkeypatch, capsys):
    """Qwen3-14B full fine-tuning with AdamW on an 80 GB card: its weights, gradients and bfloat16 AdamW state need
    110 GiB. One line says so and gives each other recipe's lengths, by the same memory model."""
    monkeypatch.setattr(plans, "host_room", lambda: 100 * GiB)
    result = ml.main(["--model", "qwen3-14b", "--gpu", "h100"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Fits at no length")]
    assert len(lines) == 1 and "adamw_torch_fused state alone need 110.03 GiB" in lines[0]
    shape, budget = mm.ModelShape.from_name("qwen3-14b"), 78 * GiB
    expected = {
        "the optimizer state in host memory": mm.StepSetup(
            optimizer="adamw", optimizer_offload=True, pending_grads=True
        ),
        "LoRA": mm.StepSetup(optimizer="adamw", lora=True, pending_grads=True),
        "QLoRA": mm.StepSetup(optimizer="adamw", lora=True, quantized="4bit", pending_grads=True),
    }
    for key, setup in expected.items():
        (found,) = [i for i in result["instead"] if i["recipe"].startswith(key)]
        assert found["stream"] == plans.stream_row(shape, setup, budget, 0, False)["max_len"] > 0
        assert f"{found['recipe']}: {found['stream']:,} ({found['trl-default']:,})" in lines[0]
    assert "8-bit AdamW (--optimizer adamw_8bit): none either" in lines[0]
    assert "configs/accelerate/zero3_offload.yaml" in lines[0]


def test_measured_runs_hold_the_optimizer_state_of_what_they_train(monkeypatch, capsys):
    """A measured trial holds a placeholder of the optimizer state: the adapters' with LoRA (it held none)."""
    specs = []

    def measure(spec, timeout=None, log=True):
        specs.append(spec)
        return {"status": "ok", "seq_len": spec.seq_len, "total_peak_mb": 10.0, "time_s": 0.1, "mode": spec.mode}

    monkeypatch.setattr(ml, "measure", measure)
    argv = ["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "20MiB", "--mode", "stream"]
    cli.main([*argv, "--lora", "--limit", "1024"])
    shape = mm.ModelShape.from_name("qwen3-tiny")
    expected = mm.optimizer_bytes(shape, mm.StepSetup(lora=True, optimizer="adamw", dtype_bytes=4))
    assert expected > 0 and {s.reserve_bytes for s in specs} == {expected}
