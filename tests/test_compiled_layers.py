"""``torch_compile=True``: each streamed layer's per-chunk body compiled (:mod:`streambp_trl.layers.compiled`), exact
against eager.

Float64 comparisons run the models' RMS norms in the model's dtype (``model_support.norms_in_model_dtype``: their own
round to float32 inside a float64 model, which a compiled norm does differently from an eager one). With them, the
compiled stream agrees with plain autograd and with the eager stream to float64 rounding, dropout included; elsewhere
(every family of the zoo, a hybrid) it agrees with the eager stream to float32 rounding.
"""

import copy
import functools
import logging
import re

import pytest
import torch
from helpers import (
    EXACT,
    MODEL,
    RECOMPUTED,
    LengthReward,
    args,
    assert_each_close,
    assert_matches_plain,
    load_model,
    load_tokenizer,
    max_rel_grad_error,
    tiny_dataset,
    train,
)
from model_support import norms_in_model_dtype
from models import FAMILIES, batch, tiny_model
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters
from zoo import tiny_causal_lm

import streambp_trl
from streambp_trl import StreamOptions, enable_streambp
from streambp_trl.layers.compiled import LayerCompile


@pytest.fixture
def _norms_in_model_dtype():
    with norms_in_model_dtype():
        yield


@pytest.fixture(autouse=True)
def _no_compile_failure(request, caplog):
    """No compiled layer fell back to eager for a failure (a backend's, or dynamo's on a frame it traces), but in the
    tests of that fallback."""
    with (
        caplog.at_level(logging.WARNING, logger="streambp_trl.layers.compiled"),
        caplog.at_level(logging.WARNING, logger="torch._dynamo.convert_frame"),
    ):
        yield
    if "runs_eagerly" not in request.node.name:
        failed = [r.getMessage() for r in caplog.records if "StreamBP: torch.compile" in r.getMessage()]
        assert not failed, failed


def _state() -> tuple[int, int]:
    """Graphs compiled so far in this process, and the frames dynamo gave up on at its recompile limit (what it cannot
    trace, such as a mixture of experts' data-dependent branch, it runs eagerly as it should)."""
    limits = sum(n for k, n in counters["unimplemented"].items() if "recompile limit" in k.lower())
    return counters["stats"]["unique_graphs"], limits


def _assert_compiled(before: tuple[int, int]) -> None:
    """Graphs were compiled since ``before`` (a :func:`_state`), and no frame reached the recompile limit."""
    graphs, failed = _state()
    assert graphs > before[0] and failed == before[1], (before, (graphs, failed))


def _loss_and_grads(model, ids, mask, labels, seed: int = 0):
    torch.manual_seed(seed)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.usefixtures("_norms_in_model_dtype")
@pytest.mark.parametrize("family", ["qwen3", "mistral"])  # dense with q/k norms; a sliding window
def test_compiled_layers_match_plain_autograd_float64(family):
    reference = tiny_model(family)
    before = _state()  # (the probe at enable runs the compiled layers too)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, torch_compile=True, **RECOMPUTED)
    assert_matches_plain(reference, streamed, *batch(padding="left"))
    _assert_compiled(before)  # the layers ran compiled graphs, not eager code


@pytest.mark.usefixtures("_norms_in_model_dtype")
@pytest.mark.parametrize(
    "plan",
    [
        {"kv_mode": "capture", **RECOMPUTED},
        {"keep_activations": 1, "keep_attention": False},
        {"keep_activations": 0, "keep_attention": True},
        {"keep_every": 2, **RECOMPUTED},
    ],
    ids=["capture", "kept-layer", "kept-attention", "segments"],
)
def test_compiled_layers_under_each_plan_choice(plan):
    reference = tiny_model("qwen3", num_hidden_layers=3)
    before = _state()
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, torch_compile=True, **plan)
    assert_matches_plain(reference, streamed, *batch(padding="right"))
    _assert_compiled(before)


@pytest.mark.usefixtures("_norms_in_model_dtype")
def test_every_layer_of_a_class_shares_its_graphs():
    """Graphs compiled per layer class and kind of run, not per layer, chunk or prefix length: a 2- and a 4-layer
    model (5 chunks a call, the last shorter) compile the same number of graphs, and a longer sequence (9 chunks, the
    last as short) none more."""
    compiled = []
    for layers in (2, 4):
        torch._dynamo.reset()
        model = tiny_model("qwen3", num_hidden_layers=layers)
        before = _state()
        model = enable_streambp(model, stream_chunk_size=5, torch_compile=True, **RECOMPUTED)
        _loss_and_grads(model, *batch(padding="right"))
        _assert_compiled(before)
        compiled.append(_state()[0] - before[0])
    assert compiled[0] == compiled[1] > 0, compiled
    before = _state()
    _loss_and_grads(model, *batch(seq_len=43, padding="right"))
    assert _state() == before


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.usefixtures("_norms_in_model_dtype")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_dropout_inside_compiled_graphs_is_replayed(device):
    """LoRA dropout runs inside the compiled graphs (inductor's C++ kernels on the CPU, Triton's on a GPU): each
    recompute draws the forward's masks, as the eager stream's does (the same random states), so the two agree to
    float64 rounding, losses and gradients."""
    targets = ["q_proj", "v_proj", "up_proj"]
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=targets, init_lora_weights=False)
    base = get_peft_model(tiny_model("qwen3").to(device), config)
    eager = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, **RECOMPUTED)
    before = _state()  # (the probe at enable runs the compiled layers too)
    compiled = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, torch_compile=True, **RECOMPUTED)
    data = [t.to(device) for t in batch(padding="right")]
    loss, _ = _loss_and_grads(eager, *data)
    loss_c, _ = _loss_and_grads(compiled, *data)
    _assert_compiled(before)
    assert abs(loss_c.item() - loss.item()) <= EXACT * abs(loss.item())
    err, where = max_rel_grad_error(eager, compiled)
    assert err < EXACT, f"relative gradient error {err:.3e} at {where}"
    torch.manual_seed(1)  # another draw: the dropout is live
    assert compiled(input_ids=data[0], attention_mask=data[1], labels=data[2]).loss.item() != loss_c.item()


def _assert_compiled_as_eager_float32(base, data) -> None:
    """``base`` (float32) streamed compiled and eager, keys/values recomputed: losses within 1e-6 and gradients within
    1e-4 relative (float32 rounding), every graph compiled."""
    torch._dynamo.reset()
    eager = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, **RECOMPUTED)
    before = _state()  # (the probe at enable runs the compiled layers too)
    compiled = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, torch_compile=True, **RECOMPUTED)
    loss, _ = _loss_and_grads(eager, *data)
    loss_c, _ = _loss_and_grads(compiled, *data)
    _assert_compiled(before)
    assert abs(loss_c.item() - loss.item()) <= 1e-6 * abs(loss.item())
    err, where = max_rel_grad_error(eager, compiled)
    assert err < 1e-4, f"relative gradient error {err:.3e} at {where}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_compiled_matches_eager_float32(family):
    """Each family of the tests' zoo (q/k/v biases, q/k norms, a sliding window, Gemma 3's interleaved layers, a fused
    qkv projection, a mixture of experts), float32: the compiled stream against the eager one, to float32 rounding."""
    _assert_compiled_as_eager_float32(tiny_model(family, dtype=torch.float32), batch(padding="left"))


@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3_5_text",  # Gated DeltaNet layers beside attention layers
        pytest.param("deepseek_v4", marks=pytest.mark.slow),  # compressed attention (states in the cache)
        pytest.param("gemma4_text", marks=pytest.mark.slow),  # keys/values shared across layers
        pytest.param("mamba", marks=pytest.mark.slow),  # a continued scan
        pytest.param("minimax", marks=pytest.mark.slow),  # lightning attention
        pytest.param("zamba2", marks=pytest.mark.slow),  # a Mamba layer inside a hybrid layer
    ],
)
def test_carried_state_compiled_matches_eager(model_type):
    """Layers whose chunks carry more than keys/values through the cache, float32: the compiled stream against the
    eager one, to float32 rounding (their float32 internals are compiled, fused, as they are)."""
    _assert_compiled_as_eager_float32(tiny_causal_lm(model_type, dtype=torch.float32), batch(padding="right"))


def test_a_graph_the_backend_fails_runs_eagerly_with_one_warning(caplog):
    """A backend that fails on every graph: each runs eagerly, with one warning naming the layer class and the error
    (its first line), and the result is the eager stream's, bit for bit."""

    def failing(graph, example_inputs):
        raise RuntimeError("no kernel for this graph\nsecond line")

    torch._dynamo.reset()
    torch._dynamo.register_backend(failing, name="streambp_failing_backend")
    base = tiny_model("qwen3")
    eager = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, **RECOMPUTED)
    failing_backend = {"torch_compile_backend": "streambp_failing_backend", **RECOMPUTED}
    compiled = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, **failing_backend)
    data = batch(padding="right")
    loss, grads = _loss_and_grads(eager, *data)
    with caplog.at_level(logging.WARNING, logger="streambp_trl.layers.compiled"):
        loss_c, grads_c = _loss_and_grads(compiled, *data)
    warned = [r.getMessage() for r in caplog.records if r.name == "streambp_trl.layers.compiled"]
    assert warned == [
        "StreamBP: torch.compile (backend 'streambp_failing_backend') failed on a part of Qwen3DecoderLayer's "
        "forward, which runs eagerly: RuntimeError: no kernel for this graph"
    ]
    assert loss_c.item() == loss.item()
    assert all(torch.equal(grads[n], grads_c[n]) for n in grads)
    torch._dynamo.reset()


def test_a_frame_dynamo_fails_to_trace_runs_eagerly_with_one_warning(caplog, monkeypatch):
    """dynamo failing on every frame it traces: each runs eagerly, one warning line for the failure (not dynamo's
    traceback), and the result is the eager stream's, bit for bit."""

    def failing(self):
        raise RuntimeError("tracing failed here")

    torch._dynamo.reset()
    base = tiny_model("qwen3")
    eager = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, **RECOMPUTED)
    monkeypatch.setattr(torch._dynamo.symbolic_convert.InstructionTranslator, "run", failing)
    compiled = enable_streambp(copy.deepcopy(base), stream_chunk_size=4, torch_compile=True, **RECOMPUTED)
    data = batch(padding="right")
    loss, grads = _loss_and_grads(eager, *data)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo.convert_frame"):
        loss_c, grads_c = _loss_and_grads(compiled, *data)
    warned = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert [r.getMessage() for r in warned] == [
        "StreamBP: torch.compile failed to trace a part of Qwen3DecoderLayer's forward, which runs eagerly: "
        "InternalTorchDynamoError: RuntimeError: tracing failed here"
    ]
    assert warned[0].exc_info is None
    assert loss_c.item() == loss.item()
    assert all(torch.equal(grads[n], grads_c[n]) for n in grads)
    monkeypatch.undo()
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"torch_compile_mode": "reduce-overhead"}, "torch_compile_mode='reduce-overhead' replays"),
        ({"torch_compile_mode": "max-autotune"}, "torch_compile_mode='max-autotune' replays"),
        ({"torch_compile_backend": "cudagraphs"}, "torch_compile_backend='cudagraphs' replays"),
        ({"torch_compile_mode": "fastest"}, "torch_compile_mode='fastest' is not a mode of inductor"),
        (
            {"torch_compile_backend": "aot_eager", "torch_compile_mode": "default"},
            "is a mode of the inductor backend, not of torch_compile_backend='aot_eager'",
        ),
    ],
)
def test_compile_settings_the_layers_cannot_run_are_refused(setting, said, tmp_path):
    """CUDA graphs (a replay overwrites the outputs the streamed layers hold), an unknown mode, a mode given to another
    backend: refused when the options or the config are built, not at the first step."""
    with pytest.raises(ValueError, match=re.escape(said)):
        StreamOptions(stream_chunk_size=8, torch_compile=True, **setting)
    with pytest.raises(ValueError, match=re.escape(said)):
        args(streambp_trl.StreamSFTConfig, tmp_path, torch_compile=True, **setting)


def test_compile_options_as_training_arguments_name_them():
    assert StreamOptions(stream_chunk_size=8).compiled is None
    assert StreamOptions(stream_chunk_size=8, torch_compile=True).compiled == LayerCompile("inductor", None)
    given = StreamOptions(stream_chunk_size=8, torch_compile_backend="aot_eager")  # a backend alone turns it on
    assert given.compiled == LayerCompile("aot_eager", None)
    mode = StreamOptions(stream_chunk_size=8, torch_compile_mode="max-autotune-no-cudagraphs").compiled
    assert mode == LayerCompile("inductor", "max-autotune-no-cudagraphs")
    with pytest.raises(ValueError, match="torch_compile must be True or False"):
        StreamOptions(stream_chunk_size=8, torch_compile="yes")


def _prompts():
    return tiny_dataset("prompt_completion", 4).remove_columns("completion")


@pytest.mark.parametrize(
    ("trainer_cls", "config_cls", "options", "given"),
    [
        (
            streambp_trl.StreamSFTTrainer,
            streambp_trl.StreamSFTConfig,
            {},
            lambda: {"train_dataset": tiny_dataset("chat", 4)},
        ),
        (
            streambp_trl.StreamDPOTrainer,
            streambp_trl.StreamDPOConfig,
            {},
            lambda: {"train_dataset": tiny_dataset("preference", 4)},
        ),
        (
            streambp_trl.StreamKTOTrainer,
            streambp_trl.StreamKTOConfig,
            {},
            lambda: {"train_dataset": tiny_dataset("unpaired_preference", 4)},
        ),
        (
            streambp_trl.StreamGRPOTrainer,
            streambp_trl.StreamGRPOConfig,
            {"num_generations": 2, "per_device_train_batch_size": 2},
            lambda: {"train_dataset": _prompts(), "reward_funcs": LengthReward()},
        ),
        (
            streambp_trl.StreamRLOOTrainer,
            streambp_trl.StreamRLOOConfig,
            {"num_generations": 2, "per_device_train_batch_size": 2},
            lambda: {"train_dataset": _prompts(), "reward_funcs": LengthReward()},
        ),
        (
            streambp_trl.StreamRewardTrainer,
            streambp_trl.StreamRewardConfig,
            {},
            lambda: {"train_dataset": tiny_dataset("preference", 4)},
        ),
        (
            streambp_trl.StreamDistillationTrainer,
            streambp_trl.StreamDistillationConfig,
            {},
            lambda: {"train_dataset": tiny_dataset("chat", 4), "teacher_model": load_model()},
        ),
    ],
)
def test_trainers_compile_the_layers_not_the_whole_model(tmp_path, trainer_cls, config_cls, options, given):
    """torch_compile=True (with its backend and mode) reaches the engine, and accelerate does not compile the whole
    model (which would trace the streamed layers' autograd Functions); the user's config is unchanged."""
    config = args(config_cls, tmp_path, torch_compile=True, torch_compile_mode="max-autotune-no-cudagraphs", **options)
    model = str(MODEL) if trainer_cls is streambp_trl.StreamRewardTrainer else load_model()  # (a 1-label head)
    trainer = trainer_cls(model=model, args=config, processing_class=load_tokenizer(), **given())
    assert config.torch_compile and not trainer.args.torch_compile
    assert str(trainer.accelerator.state.dynamo_plugin.backend) in ("NO", "DynamoBackend.NO")
    hooks = [getattr(m, "_gradient_checkpointing_func", None) for m in trainer.model.modules()]
    facts = [h.args[0] for h in hooks if isinstance(h, functools.partial)]
    assert facts and all(f.compiled == LayerCompile("inductor", "max-autotune-no-cudagraphs") for f in facts)


def test_sft_trains_compiled_as_eager(tmp_path):
    """Two SFT steps (float32) with torch_compile=True and without: the same losses and updates, to float32
    rounding."""
    torch._dynamo.reset()
    runs = {}
    for compiled in (False, True):
        before = _state()
        trainer, update = train(
            streambp_trl.StreamSFTTrainer,
            streambp_trl.StreamSFTConfig,
            tmp_path / str(compiled),
            tiny_dataset("chat", 4),
            torch_compile=compiled,
            max_steps=2,
        )
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[compiled] = (losses, update)
        assert (_state()[0] > before[0]) == compiled
    (losses, update), (losses_c, update_c) = runs[False], runs[True]
    assert losses and losses_c == pytest.approx(losses, rel=1e-5)
    assert_each_close(update, update_c, 1e-5)


def test_accelerates_whole_model_compile_is_refused_at_construction(tmp_path, monkeypatch):
    """accelerate's dynamo_backend set outside the training config (here its environment variable) would compile the
    whole model and fail at the first step: refused when the trainer is built, naming the setting to use instead."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    config = args(streambp_trl.StreamSFTConfig, tmp_path)
    with pytest.raises(ValueError, match=r"accelerate compiles the whole model \(dynamo_backend='INDUCTOR'.*"):
        streambp_trl.StreamSFTTrainer(
            model=load_model(), args=config, train_dataset=tiny_dataset("chat", 4), processing_class=load_tokenizer()
        )
