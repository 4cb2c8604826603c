"""Hooks and probes on a streamed model give what they give on the plain model (issue 16, acceptance).

On every decoder layer, hooks keep the activations they see (and a view of each) and tensor hooks keep the
gradients of the layers' inputs or outputs; two steering hooks each add a trainable vector, one changing a hidden
state in place, one returning a new one; a tensor hook scales a gradient; a linear probe adds a loss on a kept
activation. With ``keep_every`` 1, 2 and 3 over 4 layers, every kept activation equals the plain model's after the
backward (float64) and every gradient (the model's, the steering vectors', the probe's) is exact. Two placements:

* ``"forward"``: forward hooks (which see a layer's input and output), pre-hooks (plain and with keyword arguments)
  and tensor hooks on every layer. A layer watched by a forward hook keeps its input (see
  ``streambp_trl.layers.hook.input_rebuildable``), so no segment forms;
* ``"pre"``: pre-hooks (plain and with keyword arguments) and tensor hooks on every layer: segments form (the test
  counts the layers they replay), with the steering hooks between them.
"""

import copy
import functools

import pytest
import torch
from helpers import max_rel_grad_error, reference_loss
from models import batch, tiny_model
from torch import nn

from streambp_trl import enable_streambp
from streambp_trl.layers.call import layer_call

LAYERS = 4
TOL = 1e-10


class _Hooks:
    """The hooks of one model, what they keep, and the trainable tensors they add (the same values for each model)."""

    def __init__(self, model: nn.Module, placement: str):
        hidden = model.config.hidden_size
        g = torch.Generator().manual_seed(3)
        self.steer = nn.Parameter(0.1 * torch.randn(hidden, generator=g, dtype=torch.float64))
        self.shift = nn.Parameter(0.1 * torch.randn(hidden, generator=g, dtype=torch.float64))
        self.probe = nn.Parameter(torch.randn(hidden, 3, generator=g, dtype=torch.float64))
        self.kept: dict[str, torch.Tensor] = {}
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(functools.partial(self.keep_input, i))
            layer.register_forward_pre_hook(
                lambda m, args, kw, i=i: self.kept.update({f"kw{i}": args[0], f"kw_view{i}": args[0][:, 2:9]}),
                with_kwargs=True,
            )
            if placement == "forward":
                layer.register_forward_hook(functools.partial(self.keep_output, i))
        if placement == "forward":
            layers[1].register_forward_hook(self.steer_output_in_place)
            layers[2].register_forward_hook(lambda m, args, out: out * 1.5 + self.shift)
            layers[3].register_forward_hook(lambda m, args, out: self.scale_gradient(out))
            self.probed = "out0"
        else:
            layers[2].register_forward_pre_hook(self.steer_input_in_place)
            layers[0].register_forward_pre_hook(lambda m, args: (args[0] * 1.5 + self.shift,))
            layers[3].register_forward_pre_hook(lambda m, args: self.scale_gradient(args[0]))
            self.probed = "pre1"

    def keep_input(self, i: int, module: nn.Module, args: tuple) -> None:
        self.kept.update({f"pre{i}": args[0], f"pre_detached{i}": args[0].detach()})
        if args[0].requires_grad:
            args[0].register_hook(lambda g: self.kept.update({f"grad_in{i}": g}))

    def keep_output(self, i: int, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.kept.update({f"in{i}": args[0], f"out{i}": out, f"view{i}": out.detach()[:, 3:11]})
        out.register_hook(lambda g: self.kept.update({f"grad_out{i}": g}))

    def steer_output_in_place(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.add_(self.steer)

    def steer_input_in_place(self, module: nn.Module, args: tuple) -> None:
        args[0].add_(self.steer)

    @staticmethod
    def scale_gradient(t: torch.Tensor) -> None:
        t.register_hook(lambda g: g * 0.5)

    def probe_loss(self) -> torch.Tensor:
        return (self.kept[self.probed] @ self.probe).tanh().square().mean()

    def parameters(self) -> dict[str, nn.Parameter]:
        return {"steer": self.steer, "shift": self.shift, "probe": self.probe}


def _pair(keep_every: int) -> tuple[nn.Module, nn.Module]:
    reference = tiny_model("llama", num_hidden_layers=LAYERS)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, keep_every=keep_every, verify=False)
    return reference, streamed


def _loss(model: nn.Module, streamed: bool, data: tuple) -> torch.Tensor:
    ids, mask, labels = data
    if streamed:
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return reference_loss(model, ids, mask, labels)


@pytest.fixture
def replayed(monkeypatch):
    """How many layer forwards segments replayed to rebuild their layers' inputs."""
    count = [0]
    replay_chunks = layer_call.LayerCall.replay_chunks

    def counted(self, x, record):
        count[0] += 1
        return replay_chunks(self, x, record)

    monkeypatch.setattr(layer_call.LayerCall, "replay_chunks", counted)
    return count


@pytest.mark.parametrize("placement", ["forward", "pre"])
@pytest.mark.parametrize("keep_every", [1, 2, 3])
def test_hooks_and_probes_see_the_plain_model(keep_every, placement, replayed):
    reference, streamed = _pair(keep_every)
    data = batch(padding="left")
    hooks = {}
    for name, model in (("plain", reference), ("stream", streamed)):
        hooks[name] = _Hooks(model, placement)
        (_loss(model, name == "stream", data) + hooks[name].probe_loss()).backward()
    plain, stream = hooks["plain"], hooks["stream"]
    assert set(stream.kept) == set(plain.kept)
    for name, expected in plain.kept.items():
        torch.testing.assert_close(stream.kept[name], expected, rtol=1e-12, atol=1e-12, msg=name)
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"
    for name, p in plain.parameters().items():
        q = stream.parameters()[name]
        assert ((p.grad - q.grad).norm() / p.grad.norm()).item() < TOL, name
    assert (replayed[0] > 0) == (placement == "pre" and keep_every > 1)


@pytest.mark.parametrize("keep_every", [1, 3])
def test_global_hooks_see_the_plain_model(keep_every):
    """Global module hooks (forward and pre-forward, on every module) keeping the decoder layers' inputs and
    outputs."""
    reference, streamed = _pair(keep_every)
    data = batch()
    kept = {}
    for name, model in (("plain", reference), ("stream", streamed)):
        names = {m: f"{name}{i}" for i, m in enumerate(model.model.layers)}
        pre = nn.modules.module.register_module_forward_pre_hook(
            lambda m, args, names=names: kept.update({f"{names[m]}in": args[0]}) if m in names else None
        )
        post = nn.modules.module.register_module_forward_hook(
            lambda m, args, out, names=names: kept.update({f"{names[m]}out": out}) if m in names else None
        )
        try:
            loss = _loss(model, name == "stream", data)
        finally:
            pre.remove()
            post.remove()
        loss.backward()
    for key in [k for k in kept if k.startswith("plain")]:
        torch.testing.assert_close(kept[key.replace("plain", "stream")], kept[key], rtol=1e-12, atol=1e-12, msg=key)
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"


@pytest.mark.parametrize("keep_every", [1, 3])
def test_hooks_on_the_final_norm_see_the_plain_model(keep_every):
    """A hooked final norm runs as the model runs it (not inside the logit kernel): its hooks and a tensor hook on its
    output see the plain model's values, and the gradients stay exact."""
    reference, streamed = _pair(keep_every)
    data = batch()
    kept = {}
    for name, model in (("plain", reference), ("stream", streamed)):

        def keep_output(m, args, out, n=name):
            kept[f"{n}norm_out"] = out
            out.register_hook(lambda g: kept.update({f"{n}norm_grad": g}))

        model.model.norm.register_forward_pre_hook(lambda m, args, n=name: kept.update({f"{n}norm_in": args[0]}))
        model.model.norm.register_forward_hook(keep_output)
        _loss(model, name == "stream", data).backward()
    for key in ("norm_in", "norm_out", "norm_grad"):
        assert f"stream{key}" in kept, f"the streamed model's {key} hook did not run"
        torch.testing.assert_close(kept[f"stream{key}"], kept[f"plain{key}"], rtol=1e-12, atol=1e-12, msg=key)
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"


@pytest.mark.parametrize("kind", ["forward", "pre", "backward"])
def test_a_hook_on_the_lm_head_is_refused_by_name(kind):
    """The logit kernel never forms the logits an lm_head hook would see: a streamed call says so instead of skipping
    the hook silently."""
    _, streamed = _pair(1)
    register = {
        "forward": lambda h: h.register_forward_hook(lambda m, a, o: None),
        "pre": lambda h: h.register_forward_pre_hook(lambda m, a: None),
        "backward": lambda h: h.register_full_backward_hook(lambda m, gi, go: None),
    }[kind]
    handle = register(streamed.lm_head)
    with pytest.raises(ValueError, match="lm_head has a forward or backward hook.*disable_streambp"):
        _loss(streamed, True, batch())
    handle.remove()
    _loss(streamed, True, batch()).backward()
