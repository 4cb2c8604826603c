"""Training from parsed arguments: the model and dataset the config names (one-line errors when they cannot be
loaded), the objective's ``Stream*Trainer``, and the saved result."""

from __future__ import annotations

import os

from ..trainers.objectives import OBJECTIVES
from .arguments import UsageError, _check_launch, _one_line, reward_functions


def _model_path(name: str, revision: str | None, field_name: str) -> str:
    """``name`` as the trainer should load it: a local directory as an absolute path (a LoRA adapter saved from it
    then names its base model from anywhere); otherwise a Hub repository, whose config is fetched (or found in the
    cache) now, so that a wrong name or no network is said before any data is loaded."""
    if os.path.isdir(name):
        return os.path.abspath(name)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{field_name} {name!r} is not a directory (relative to {os.getcwd()})"
    try:
        hf_hub_download(name, "config.json", revision=revision)
    except LocalEntryNotFoundError as error:
        raise UsageError(
            f"{where} nor in the Hugging Face cache, and the Hub cannot be reached (no network, or HF_HUB_OFFLINE=1): "
            f"give a local directory, or download it once with network access (`hf download {name}`)"
        ) from error
    except EntryNotFoundError:
        pass  # a Hub repository without config.json (a PEFT adapter): loading it says what it lacks
    except GatedRepoError as error:
        raise UsageError(f"{where}, and on the Hub it is gated: accept its terms there and `hf auth login`") from error
    except RevisionNotFoundError as error:
        raise UsageError(f"{where}, and on the Hub it has no revision {revision!r}: fix `model_revision`") from error
    except (RepositoryNotFoundError, HFValidationError) as error:
        raise UsageError(
            f"{where} nor a model on the Hugging Face Hub: fix the path or the name (a private model needs "
            "`hf auth login`)"
        ) from error
    return name


# the builder of `datasets` that reads a data file, by its extension
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _file_builder(path: str) -> str:
    """The ``datasets`` builder for a data file given as ``dataset_name`` (``load_dataset`` takes a directory or a
    Hub name there, not a file), or a :class:`UsageError` giving the form that loads it."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in _FILE_BUILDERS:
        raise UsageError(
            f"dataset_name {path!r} is a file whose format its extension does not say ({', '.join(_FILE_BUILDERS)}): "
            "give `datasets: [{path: json, data_files: FILE}]` (or csv, parquet, text) in the config"
        )
    return _FILE_BUILDERS[extension]


def _load_dataset(script_args, dataset_args):
    from datasets import load_dataset
    from trl import get_dataset

    try:
        if dataset_args.datasets:
            return get_dataset(dataset_args)
        if script_args.dataset_name and os.path.isfile(script_args.dataset_name):
            return load_dataset(_file_builder(script_args.dataset_name), data_files=script_args.dataset_name)
        if script_args.dataset_name:
            return load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    except FileNotFoundError as error:
        raise UsageError(
            f"cannot load the dataset: {_one_line(error)} (a config's data paths are looked up next to the config "
            "file, then from the current directory)"
        ) from error
    except OSError as error:  # a Hub dataset without network
        raise UsageError(f"cannot load the dataset: {_one_line(error)}") from error
    raise UsageError("Give a dataset: `datasets:` (a list of {path, data_files, ...}) or `dataset_name`.")


def _teacher(training_args, model_args) -> str:
    """The teacher of a ``distillation`` run, checked like the model, loaded as TRL's distillation script loads it
    (the model's ``dtype`` and attention, the teacher's revision, any ``teacher_model_init_kwargs`` over them)."""
    name, revision = training_args.teacher_model_name_or_path, training_args.teacher_model_revision
    if not name:
        raise UsageError("Give the teacher: `teacher_model_name_or_path` (a Hub name or a local directory).")
    loading = {
        "revision": revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    training_args.teacher_model_init_kwargs = {**loading, **(training_args.teacher_model_init_kwargs or {})}
    return _model_path(name, revision, "teacher_model_name_or_path")


def _check_rows(trainer, script_args) -> None:
    """Refuse a training set that preparing emptied (every row dropped: truncated to ``max_length`` with no trained
    token left), which would fail in the sampler with a long traceback (``num_samples=0``)."""
    rows = trainer.train_dataset
    if rows is None or not hasattr(rows, "__len__") or len(rows):
        return
    args = trainer.args
    why = ""
    if getattr(args, "max_length", None) is not None:
        masked = [n for n in ("assistant_only_loss", "completion_only_loss") if getattr(args, n, None)]
        why = f" (truncated to max_length={args.max_length}" + (
            f", no token left to train with {' and '.join(masked)})" if masked else ")"
        )
    raise UsageError(
        f"no training rows left: preparing split {script_args.dataset_train_split!r} dropped every row{why}; "
        "raise max_length, or check the dataset's columns"
    )


# accelerate's distributed types in words
_DISTRIBUTED = {"MULTI_CPU": "data parallel, gloo", "MULTI_GPU": "data parallel, DDP", "FSDP": "FSDP"}


def _processes(trainer) -> str:
    """``1 process (cpu)``, ``2 processes (data parallel, gloo, cpu)``, ``8 processes (DeepSpeed ZeRO-3, cuda)``."""
    state = trainer.accelerator.state
    kind = state.distributed_type.value
    if kind == "DEEPSPEED":
        kind = f"DeepSpeed ZeRO-{state.deepspeed_plugin.zero_stage}"
    words = [] if kind == "NO" else [_DISTRIBUTED.get(kind, kind)]
    processes = f"{state.num_processes} process" + ("es" if state.num_processes > 1 else "")
    return f"{processes} ({', '.join([*words, trainer.args.device.type])})"


def train(objective: str, script_args, training_args, model_args, dataset_args) -> str:
    """Train as ``trl <objective>`` does, with the objective's ``Stream*Trainer``; returns the output directory."""
    from trl import get_peft_config, get_quantization_config

    how = OBJECTIVES[objective]
    _check_launch(training_args)
    if how.classifier and model_args.use_peft and model_args.lora_task_type != "SEQ_CLS":
        raise UsageError(
            f"{objective} trains a sequence classifier: set `lora_task_type: SEQ_CLS` (got "
            f"{model_args.lora_task_type!r}), so that PEFT trains its new score head in full (modules_to_save) "
            "besides the LoRA adapters"
        )
    if not model_args.model_name_or_path:
        raise UsageError("Give the model to train: `model_name_or_path` (a Hub name or a local directory).")
    revision = model_args.model_revision
    model_args.model_name_or_path = _model_path(model_args.model_name_or_path, revision, "model_name_or_path")
    if how.rewards and script_args.reward_model_name_or_path:
        script_args.reward_model_name_or_path = _model_path(
            script_args.reward_model_name_or_path, None, "reward_model_name_or_path"
        )
    rewards = {"reward_funcs": reward_functions(script_args)} if how.rewards else {}
    teacher = {"teacher_model": _teacher(training_args, model_args)} if how.teacher else {}

    model_init_kwargs = {
        "revision": revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    dataset = _load_dataset(script_args, dataset_args)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        split, strategy = script_args.dataset_test_split, str(training_args.eval_strategy.value)
        if split not in dataset:
            raise UsageError(
                f"eval_strategy={strategy!r} needs an evaluation split, but the dataset has no "
                f"split {split!r} (it has {sorted(dataset)}). Set `dataset_test_split` to one of them, add a "
                "test split to the dataset, or set `eval_strategy: 'no'`."
            )
        eval_dataset = dataset[split]
    trainer = how.trainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        **rewards,
        **teacher,
    )
    _check_rows(trainer, script_args)
    trainer.accelerator.print(f"Training on {_processes(trainer)}")
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    # trackers finished and the process group destroyed before the interpreter exits: a gloo group left to the
    # interpreter's teardown can abort a process ("terminate called without an active exception") after training
    trainer.accelerator.end_training()
    return training_args.output_dir
