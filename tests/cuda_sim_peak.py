"""What is alive at a streamed step's simulated CUDA peak (``../shared/cudasim``), for Qwen3-8B's widths with two
layers. A script run in a subprocess by ``tests/test_peak_contents.py`` (the simulator must be imported before
torch)::

    python tests/cuda_sim_peak.py CUDASIM_DIR SEQ_LEN CASE [CASE ...]     # one JSON line per case on stdout

Cases are the calls the stream trainers make: ``token-mean`` (SFT: ``fused_lm_head=True`` with
``token_mean_loss=True``, so the logit kernel may form its gradient in the forward), ``weighted`` (DPO, KTO, GRPO,
RLOO: ``fused_lm_head=True``, each row's log-probability weighted by the loss), ``labels`` (the model's own
``labels=`` loss), ``distillation`` (the divergence kernel of ``StreamDistillationTrainer`` on a student's and a
teacher's final hidden states, in the form the trainer takes for the model: ``EngineState.logit_gradient_form``).
Each line has the peak, where it was, and every tensor storage of at least ``SEQ_LEN x 1024`` elements live at the
peak (GiB, dtype, shape, the op that made it, forward/backward), the parameters and their gradients left out.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, sys.argv[1])
import fakecuda  # noqa: E402, F401  (before torch)
import sim  # noqa: E402
import torch  # noqa: E402

from streambp_trl import enable_streambp  # noqa: E402

seq_len, cases = int(sys.argv[2]), sys.argv[3:]


def distillation(seq_len: int) -> dict:
    """The divergence kernel's forward and backward alone: both models' (T, hidden) final hidden states and LM heads
    of Qwen3-8B's widths, as FakeTensors on CUDA, the student's with gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from streambp_trl.engine import logit_gradient_form
    from streambp_trl.logits import chunked_divergence

    fake = FakeTensorMode()
    sim.stub_trl_triton()
    student = sim.build_model("qwen3-8b", torch.bfloat16, "cuda", fake, layers=2)
    enable_streambp(student, stream_chunk_size=2048, verify=False)
    head = student.lm_head
    form = logit_gradient_form(student, head, seq_len, 2048, torch.device("cuda"), False)
    tracker = sim.LiveBytes(who=64)
    with fake:
        hidden = torch.empty(seq_len, head.in_features, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        teacher_hidden = torch.empty(seq_len, head.in_features, dtype=torch.bfloat16, device="cuda")
        teacher_weight = torch.empty_like(head.weight, requires_grad=False)
        head.weight.grad = torch.zeros_like(head.weight)
    for t in [*student.parameters(), hidden, teacher_hidden, teacher_weight, head.weight.grad]:
        tracker.track(t, "model")
    with fake, tracker, sim.Oracle():
        divergence, _ = chunked_divergence(
            hidden, head.weight, None, teacher_hidden, teacher_weight, None, beta=0.5, token_chunk=2048,
            form=form,
        )  # fmt: skip
        divergence.sum().backward()
    live = [[round(b / 2**30, 3), *(i[1:] if i else ["?"])] for b, i in tracker.live_at_peak.get("cuda", [])]
    return {"peak_gib": tracker.peak["cuda"] / 2**30, "at_peak": tracker.at_peak.get("cuda"), "live_at_peak": live}


OPTIONS = {"token-mean": {"token_mean_loss": True}, "weighted": {}, "labels": {}}
MODES = {"token-mean": "streambp", "weighted": "streambp", "labels": "streambp-labels"}
for case in cases:
    if case == "distillation":
        rec = distillation(seq_len)
        big = [x for x in rec["live_at_peak"] if x[3] != "model"]
        print(json.dumps({"case": case, "peak_gib": rec["peak_gib"], "at_peak": rec["at_peak"], "live": big}))
        continue
    kwargs = {"verify": False, **OPTIONS[case]}
    rec = sim.simulate(
        "qwen3-8b",
        torch.bfloat16,
        MODES[case],
        seq_len,
        chunk=2048,
        logits_chunk=2048,
        grads_ready=True,
        stream_kwargs=kwargs,
        layers=2,
        who=64,
    )
    big = [x for x in rec["live_at_peak"] if x[3] not in ("model", "grads")]
    print(json.dumps({"case": case, "peak_gib": rec["peak_gib"], "at_peak": rec["at_peak"], "live": big}), flush=True)
os._exit(0)
