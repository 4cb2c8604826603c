"""``streambp-trl COMMAND --config configs/COMMAND_tiny.yaml`` with each sequence split across the processes, as
``accelerate launch --config_file configs/accelerate/zero3_sp.yaml -m streambp_trl.cli COMMAND ...`` runs it on GPUs
(``--cp``: configs/accelerate/fsdp2_cp.yaml), for tests/test_sequence_split.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/sequence_split_cli.py [--cp] COMMAND OUT \
        [ARGS]

On a machine without GPUs ``accelerate launch`` enables neither DeepSpeed nor FSDP nor their splits, so this does what
it would: accelerate's DeepSpeed (or FSDP) state on gloo (tests/distributed_trainer.py's ``gloo_state``), the
accelerate config's ``parallelism_config`` in the environment it hands each process (``PARALLELISM_CONFIG_*``, the
split over every process), and zero3_sp.yaml's DeepSpeed config (configs/accelerate/zero3.json) through the command's
``--deepspeed`` (fsdp2_cp.yaml's ``fsdp_config`` in the environment, ``FSDP_*``); then the command itself, with
``ARGS`` after the config. Each process writes nothing of its own: the command's log is read.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    faulthandler.dump_traceback_later(300, exit=True)  # a hung collective shows where, instead of hanging the suite
    given = sys.argv[1:]
    cp = given[0] == "--cp"
    command, output_dir, *rest = given[cp:]  # (OUT: the command's output_dir)
    from distributed_trainer import gloo_state

    root = HERE.parent
    if cp:
        import yaml

        gloo_state("fsdp2")
        launched = yaml.safe_load((root / "configs" / "accelerate" / "fsdp2_cp.yaml").read_text())
        fsdp = {
            k.upper(): str(v).lower() if isinstance(v, bool) else str(v) for k, v in launched["fsdp_config"].items()
        }
        os.environ.update(fsdp)
        split = {k.upper(): str(v) for k, v in launched["parallelism_config"].items()}
        os.environ.update(split | {"PARALLELISM_CONFIG_CP_SIZE": os.environ["WORLD_SIZE"]})
        launch = ()
    else:
        gloo_state("zero3")
        split = {"SIZE": os.environ["WORLD_SIZE"], "BACKEND": "deepspeed", "DP_REPLICATE_SIZE": "1"}
        split.update(SEQ_LENGTH_IS_VARIABLE="true", ATTN_IMPLEMENTATION="sdpa")
        os.environ.update(
            {f"PARALLELISM_CONFIG_{'SP_' if k != 'DP_REPLICATE_SIZE' else ''}{k}": v for k, v in split.items()}
        )
        launch = ("--deepspeed", str(root / "configs" / "accelerate" / "zero3.json"))
    os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    from streambp_trl.cli import main as cli

    cli(
        [
            command,
            *("--config", str(root / "configs" / f"{command}_tiny.yaml")),
            *launch,
            *("--use_cpu", "false", "--accelerator_config", '{"use_configured_state": true}'),
            *("--output_dir", output_dir, *rest),
        ]
    )
    os._exit(0)  # gloo's process-group teardown can hang on this machine; everything is written


if __name__ == "__main__":
    main()
