"""The resolved configuration: every key distkit knows, its default and its meaning.

One flat namespace of top-level keys (RETURNN style) plus the canonical ``distributed``
dict. Seed spellings (``torch_distributed``, ``compute_setup``, ``nprocs``, ``backend``,
``use_horovod``, ``deepspeed_config``) are folded into these fields by
:mod:`distkit.config.resolve`; nothing else in distkit reads the raw spellings.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: Engines a config may name; the registry in :mod:`distkit.backends` says which are built.
KNOWN_BACKENDS = ("ddp", "deepspeed", "horovod", "mpi")
REDUCE_TYPES = ("grad", "param")
DATA_DISTRIBUTIONS = ("shard", "random_seed_offset")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
PG_BACKENDS = ("gloo", "nccl")


@dataclass
class DistributedConfig:
    """The canonical ``distributed = {...}`` dict (DESIGN.md section 4)."""

    #: the engine: "ddp" | "deepspeed" | "horovod" | "mpi"
    backend: str = "ddp"
    #: "grad": mean gradient every step; "param": local steps + periodic parameter averaging.
    reduce_type: str = "grad"
    #: param mode: average parameters every this many optimizer steps.
    param_sync_step: int = 100
    #: param mode: average when this many seconds (float) passed since the last sync, decided
    #: on the maximum elapsed time over ranks so every rank takes the same decision.
    param_sync_time_diff: Optional[float] = None
    #: process-group / collective timeout in seconds (gloo's own default is 30 minutes).
    timeout_s: float = 300.0
    #: keyword arguments for DistributedDataParallel (grad mode), e.g. bucket_cap_mb.
    options: dict[str, Any] = field(default_factory=dict)
    #: torch.distributed backend; None = nccl on CUDA, else gloo.
    pg_backend: Optional[str] = None
    #: param mode outer optimizer on the averaged update (DiLoCo / SlowMo); None = plain averaging.
    outer_optimizer: Optional[dict[str, Any]] = None
    #: multiply learning_rate by the world size (RETURNN's horovod_scale_lr)
    scale_lr: bool = False
    #: grad mode: average gradients (True) or sum them (False, RETURNN's horovod_avg_grad = False)
    avg_grad: bool = True
    #: gradient compression for the collective: "none" | "fp16" (horovod)
    compression: str = "none"
    #: horovod: fail instead of falling back to the mpi engine when Horovod is not importable
    require_horovod: bool = False
    #: mpi engine: gradient bucket size in MiB (buckets are all-reduced as soon as they are full)
    bucket_cap_mb: float = 25.0
    #: deepspeed: the DeepSpeed config (a dict, after loading the JSON file if a path was given)
    deepspeed_config: Optional[dict[str, Any]] = None
    #: deepspeed param mode: ranks per replica group (ZeRO shards inside a group, groups average)
    param_sync_group_size: int = 1


@dataclass
class RunConfig:
    """Every top-level key. Units: steps are optimizer steps, sizes are per rank unless named global."""

    #: built-in task ("digits" | "charlm"), or None for your own model + dataset
    task: Optional[str] = "digits"
    #: ``model() -> nn.Module`` (or "module:function"); replaces the task's model
    model: Optional[Callable[..., Any]] = None
    #: ``dataset() -> (train, eval)`` (or "module:function"); eval may be None
    dataset: Optional[Callable[..., Any]] = None
    #: ``loss(outputs, targets) -> scalar tensor``; None = the task's (cross-entropy)
    loss: Optional[Callable[..., Any]] = None
    #: datasets, dataset factories, or "module:function" strings (instead of ``dataset``)
    train_dataset: Any = None
    #: like train_dataset, for evaluation (None = no eval set unless ``dataset`` gives one)
    eval_dataset: Any = None
    #: ``collate_fn(list of items) -> batch`` for the DataLoader; None = torch's default_collate
    collate_fn: Optional[Callable[..., Any]] = None
    #: DataLoader worker processes (the batch order stays the same)
    num_workers: int = 0
    #: ``train_step(model, batch) -> loss | (loss, metrics_dict)``; None = HF ``model(**batch).loss`` for
    #: dict batches without ``loss``, else ``loss(model(inputs), targets)``
    train_step: Optional[Callable[..., Any]] = None
    #: like train_step, for evaluation (under torch.no_grad); None = train_step
    eval_step: Optional[Callable[..., Any]] = None
    #: evaluation metrics: "accuracy" or callables ``(outputs, targets) -> float``; None = the task's own
    #: (accuracy for the built-in tasks, none for a custom one). For dict batches (Hugging Face), accuracy
    #: compares the output's ``logits`` with the batch's ``labels``
    metrics: Optional[list[Any]] = None
    #: ``{"class": <any torch.optim class name, case-insensitive>, **kwargs}`` (lr = learning_rate), or a
    #: factory ``params -> Optimizer`` (it sets its own lr); a factory with a parameter named
    #: ``named_parameters`` gets ``(name, parameter)`` pairs (Hugging Face's no-decay grouping by name)
    optimizer: Any = field(default_factory=lambda: {"class": "sgd"})
    #: None, ``{"class": "constant"|"linear"|"cosine"|"step"|<torch.optim.lr_scheduler class>, "warmup_steps": N,
    #: ...}`` or a factory ``(optimizer, total_steps) -> scheduler``; stepped once per optimizer step
    lr_scheduler: Any = None
    #: "32" (fp32), "bf16-mixed" (torch.autocast to bfloat16, CPU or CUDA) or "16-mixed" (float16 autocast with
    #: a GradScaler, CUDA only); on DeepSpeed it selects the config's bf16/fp16 block instead
    precision: str = "32"
    #: objects with any of on_train_start(trainer), on_step_end(trainer, metrics), on_eval_end(trainer, metrics),
    #: on_checkpoint(trainer, path), on_train_end(trainer, summary); called on every rank
    callbacks: list[Any] = field(default_factory=list)
    #: the optimizer's lr (a factory optimizer sets its own)
    learning_rate: float = 0.1
    #: samples per rank per micro-step (like DDP's per-process batch and DeepSpeed's micro batch).
    batch_size: int = 32
    #: passes over the training data (when max_steps is None)
    num_epochs: int = 1
    #: the run length in optimizer steps (epochs repeat the data); None = num_epochs epochs
    max_steps: Optional[int] = None
    #: seed of the model's initialisation and the data order (the same on every rank)
    seed: int = 42
    #: "auto" (CUDA if visible), "cpu" or "cuda"
    device: str = "auto"
    #: "shard" (each rank a disjoint part of every global batch) or "random_seed_offset" (RETURNN)
    data_distribution: str = "shard"
    #: micro-steps per optimizer step (gradient accumulation)
    accum_grad_multiple_step: int = 1
    #: max global gradient norm (L2); None = no clipping.
    gradient_clip: Optional[float] = None
    #: evaluate on the eval set every N optimizer steps (and always at the end)
    eval_every: Optional[int] = None
    #: write a metrics.jsonl line (loss, metrics, lr, samples/s) every N optimizer steps
    log_every: int = 10
    #: save a checkpoint every N optimizer steps (and always at the end)
    checkpoint_every: Optional[int] = None
    #: where rank 0 writes config.resolved.json, metrics.jsonl, summary.json and checkpoints/
    output_dir: str = "runs/default"
    #: "auto" (continue from the newest complete checkpoint in output_dir/checkpoints: `latest`, or the
    #: newest intact one when `latest` is damaged; stops rather than start over when none is complete),
    #: "none" (start from step 0; the earlier run's checkpoints are replaced), a checkpoint dir (any engine,
    #: number of ranks or mode), or unset: start from step 0, but stop with one line if output_dir holds checkpoints.
    resume: Optional[str] = None
    #: write periodic checkpoints in a background thread (state copied to CPU memory first); each becomes
    #: complete (`latest`) at the next checkpoint; the final one is always synchronous
    checkpoint_async: bool = False
    #: complete checkpoints kept in output_dir/checkpoints (older ones are deleted once a new one is complete)
    keep_checkpoints: int = 3
    #: a tqdm bar on rank 0
    progress_bar: bool = True
    #: engine and mode: see the distributed.* keys
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    #: number of local ranks distkit spawns itself (perceptrain's nprocs); ignored under a launcher.
    nprocs: int = 1
    #: task charlm: model size ("small" | "medium" | "large")
    charlm_size: str = "small"
    #: task charlm: characters per sample
    charlm_seq_len: int = 64
    #: task charlm: its text ("pydoc": 0.47M characters; "stdlib": the standard library's source, 31.5M)
    charlm_corpus: str = "pydoc"
    #: set by the resolver: the top-level keys the user wrote (not a config key)
    explicit_keys: Optional[frozenset[str]] = field(default=None, metadata={"internal": True})
    #: set by the resolver: one-line notes for rank 0 to print at start (e.g. an engine spelling replaced)
    notes: tuple[str, ...] = field(default=(), metadata={"internal": True})

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict; callables become "module:qualname" strings, other objects their repr.
        (Not ``dataclasses.asdict``: it would deep-copy a dataset given as a value.)"""
        return _jsonable({k: getattr(self, k) for k in TOP_LEVEL_KEYS})


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if callable(value):
        mod = getattr(value, "__module__", None) or "?"
        return f"{mod}:{getattr(value, '__qualname__', repr(value))}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


TOP_LEVEL_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig) if not f.metadata.get("internal"))
DISTRIBUTED_KEYS = tuple(f.name for f in dataclasses.fields(DistributedConfig))

#: Seed spellings accepted at top level and folded into the fields above.
ALIAS_KEYS = (
    "torch_distributed",      # RETURNN: selects ddp
    "compute_setup",          # perceptrain: same as device ("gpu" = "cuda")
    "backend",                # perceptrain: torch.distributed backend (gloo | nccl)
    "param_outer_optimizer",  # distributed.outer_optimizer
    "use_horovod",            # RETURNN: selects horovod
    "horovod_reduce_type", "horovod_param_sync_step", "horovod_param_sync_time_diff",
    "horovod_scale_lr", "horovod_dataset_distribution", "horovod_avg_grad",
    "horovod_compression", "horovod_require",
    "deepspeed_config",       # DeepSpeed: selects deepspeed
)
ALL_KEYS = TOP_LEVEL_KEYS + ALIAS_KEYS


def key_docs() -> list[tuple[str, Any, str]]:
    """``(key, default, meaning)`` for every key, top-level then ``distributed.*``, from the ``#:`` comments
    above the fields in this module (one source for the code and for ``distkit keys``)."""
    import inspect
    import re
    import sys

    docs: dict[str, str] = {}
    owner, pending = "", []  # the class being read, the #: lines waiting for their field
    for line in inspect.getsource(sys.modules[__name__]).splitlines():
        m = re.match(r"class (\w+)", line)
        if m:
            owner, pending = m.group(1), []
            continue
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = re.match(r"    (\w+): ", line)
        if m and owner in ("RunConfig", "DistributedConfig"):
            prefix = "distributed." if owner == "DistributedConfig" else ""
            docs[prefix + m.group(1)] = " ".join(pending)
        pending = []
    top, dist = RunConfig(), DistributedConfig()
    rows = [(k, getattr(top, k), docs.get(k, "")) for k in TOP_LEVEL_KEYS if k != "distributed"]
    rows += [(f"distributed.{k}", getattr(dist, k), docs.get(f"distributed.{k}", "")) for k in DISTRIBUTED_KEYS]
    return rows
