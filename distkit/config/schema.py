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
KNOWN_BACKENDS = ("ddp", "deepspeed", "horovod", "mpi", "fsdp")
REDUCE_TYPES = ("grad", "param")
DATA_DISTRIBUTIONS = ("shard", "random_seed_offset")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
PG_BACKENDS = ("gloo", "nccl")


#: seconds: the least start-up wait when ``distributed.startup_timeout_s`` is None (see :meth:`DistributedConfig.startup_s`)
STARTUP_FLOOR_S = 60.0


@dataclass
class DistributedConfig:
    """The canonical ``distributed = {...}`` dict (DESIGN.md section 4)."""

    #: the engine: "ddp" | "deepspeed" | "horovod" | "mpi" | "fsdp"
    backend: str = "ddp"
    #: "grad": mean gradient every step; "param": local steps + periodic parameter averaging.
    reduce_type: str = "grad"
    #: param mode: average parameters every this many optimizer steps.
    param_sync_step: int = 100
    #: param mode: average when this many seconds (float) passed since the last sync, decided
    #: on the maximum elapsed time over ranks so every rank takes the same decision.
    param_sync_time_diff: Optional[float] = None
    #: process-group / collective timeout of training in seconds, 1 to 1e7 (gloo's own default is 30 minutes):
    #: from the first optimizer step on, a rank silent this long is named, and the job ends.
    timeout_s: float = 300.0
    #: seconds every wait of start-up may last: the engine's rendezvous (init_process_group, MPI_Init, hvd.init)
    #: and every collective and heartbeat until the ranks meet after their first optimizer step (set-up's
    #: broadcasts, the checkpoint choice, rank 0's first writes); a rank still missing then is named, and the job
    #: ends. None = the larger of timeout_s and 60: other ranks' interpreter and library imports come first,
    #: and set-up work drifts ranks apart by seconds, on a loaded machine.
    startup_timeout_s: Optional[float] = None
    #: keyword arguments for DistributedDataParallel (grad mode), e.g. bucket_cap_mb.
    options: dict[str, Any] = field(default_factory=dict)
    #: torch.distributed backend; None = nccl on CUDA, else gloo.
    pg_backend: Optional[str] = None
    #: param mode outer optimizer on the averaged update (DiLoCo / SlowMo), e.g. ``{"class": "nesterov", "lr": 0.7,
    #: "momentum": 0.9}``, on the parameters (floating buffers take the plain mean); None = plain averaging.
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
    #: fsdp: FSDP2's options: ``units`` (module class names that get their own fully_shard unit; None = a Hugging
    #: Face model's _no_split_modules, else each direct child holding parameters), ``reshard_after_forward``
    #: (True), ``param_dtype`` / ``reduce_dtype`` (MixedPrecisionPolicy: "bfloat16" | "float16" | None),
    #: ``cpu_offload`` (False), ``shard_group_size`` (hybrid sharding: ranks per shard group; None = all); docs/fsdp.md
    fsdp: dict[str, Any] = field(default_factory=dict)
    #: param mode, every engine: ranks per replica group (gradients reduced inside a group every step, ZeRO
    #: shards inside it; the groups average every param_sync_step); 1 = every rank its own replica
    param_sync_group_size: int = 1
    #: param mode, every engine: F fragments (Streaming DiLoCo). The averaged tensors, concatenated, are cut into F
    #: contiguous ranges of near-equal bytes; fragment i syncs at steps i*H//F + k*H (H = param_sync_step), or, with
    #: param_sync_time_diff T, the fragments sync in turn every T/F seconds. Each fragment still syncs every H steps
    #: while the bytes per sync fall F-fold; with the outer optimizer each range has its own anchor and momentum.
    #: 1 <= F <= H; 1 = the whole model at once
    param_sync_fragments: int = 1
    #: param mode, every engine: what crosses the link at a sync is each rank's pseudo-gradient (anchor - local),
    #: encoded: "bf16" | "fp16" (half the bytes of fp32) | "int8" (a quarter, plus one fp32 scale per block of
    #: 1024 elements) | "int4" (an eighth, plus one fp32 scale per block of 128: 0.53 bytes per element) | "e3m0"
    #: (Streaming DiLoCo's 4-bit float: sign and a 3-bit exponent, each value 0 or +-absmax * 2^-e, e = 0..6, per
    #: block of 128; int4's bytes); the mean is taken in fp32 (an all-to-all, then an all-gather of the encoded
    #: mean: the same on every rank) | "topk"
    #: (sparse: per chunk of param_sync_topk_chunk elements the largest param_sync_topk_density of them by
    #: magnitude, as int16 indices and param_sync_topk_bits-bit values with one fp32 scale; every rank gathers
    #: every rank's encoding and sums them in rank order). Floating buffers go uncompressed. Keeps one copy of the
    #: model (the anchor). "none" = the fp32 all-reduce of the parameters
    param_sync_compression: str = "none"
    #: param_sync_compression "topk": the fraction of each chunk's elements sent, 0 < density <= 1
    #: (k = ceil(density * chunk) per chunk)
    param_sync_topk_density: float = 0.03125
    #: param_sync_compression "topk": bits per kept value, 2 | 4 | 8 (symmetric, one fp32 scale per chunk: its
    #: largest magnitude over 1, 7 or 127)
    param_sync_topk_bits: int = 4
    #: param_sync_compression "topk": elements per chunk, 1..32768 (indices are int16 within the chunk)
    param_sync_topk_chunk: int = 4096
    #: param mode with param_sync_compression: add what the codec could not send of a rank's pseudo-gradient to
    #: its next one (error feedback; one fp32 copy of the parameters per rank, in its own checkpoint file)
    param_sync_error_feedback: bool = True
    #: param mode, every engine: tau steps a sync's exchange runs in the background while training goes on; its
    #: result is applied tau steps later, and the local progress made meanwhile is kept on top of it (it goes into
    #: the next exchange). 0 = blocking (the sync waits for its exchange). Step rule only; tau * F < H
    param_sync_overlap: int = 0

    def startup_s(self) -> float:
        """Seconds a rank waits at start-up for the others: ``startup_timeout_s``, or when None the larger of
        ``timeout_s`` and :data:`STARTUP_FLOOR_S` (a short ``timeout_s`` for stalls in training must not end a
        healthy job whose ranks are still importing torch on a loaded machine)."""
        if self.startup_timeout_s is not None:
            return float(self.startup_timeout_s)
        return max(float(self.timeout_s), STARTUP_FLOOR_S)


@dataclass
class RunConfig:
    """Every top-level key. Units: steps are optimizer steps, sizes are per rank unless named global."""

    #: built-in task, or None for your own model + dataset: "digits" (sklearn's 1,797 handwritten digits, MLP) or
    #: "charlm" (causal transformer on CPython's ``pydoc_data`` text)
    task: Optional[str] = "digits"
    #: ``model() -> nn.Module`` (a callable in a Python config, or "module:function"); replaces the task's model
    model: Optional[Callable[..., Any]] = None
    #: ``dataset() -> (train, eval)`` (a callable in a Python config, or "module:function"); eval may be None, or
    #: ``dataset()`` returns the train dataset alone
    dataset: Optional[Callable[..., Any]] = None
    #: ``loss(outputs, targets) -> scalar tensor`` (a callable or "module:function") for ``(inputs, targets)`` items;
    #: None = the task's (cross-entropy)
    loss: Optional[Callable[..., Any]] = None
    #: datasets, dataset factories, or "module:function" strings (instead of ``dataset``)
    train_dataset: Any = None
    #: like train_dataset, for evaluation (None = no eval set unless ``dataset`` gives one)
    eval_dataset: Any = None
    #: ``collate_fn(list of items) -> batch`` for the DataLoader; None = torch's default_collate. Items and batches
    #: may be tensors, tuples, lists, dicts, dataclasses or HF ``BatchEncoding``
    collate_fn: Optional[Callable[..., Any]] = None
    #: DataLoader worker processes (the batch order stays the same)
    num_workers: int = 0
    #: ``train_step(model, batch) -> loss | (loss, metrics_dict)``; its metrics are averaged over ranks and logged.
    #: None = HF ``model(**batch).loss`` for dict batches without ``loss``, else ``loss(model(inputs), targets)``
    train_step: Optional[Callable[..., Any]] = None
    #: like train_step, for evaluation (under torch.no_grad); None = train_step
    eval_step: Optional[Callable[..., Any]] = None
    #: evaluation metrics, reported as ``eval_<name>``: ``["accuracy"]`` or callables
    #: ``(outputs, targets) -> float``; None = the task's own (accuracy for the built-in tasks, none for a custom
    #: one: no accuracy for a regression). On dict batches (Hugging Face) outputs = the model output's ``logits``,
    #: targets = the batch's ``labels``, as they are: no shift for a causal LM, labels of -100 counted (give a
    #: callable or an ``eval_step`` for those); a batch without ``labels`` or an output without ``logits`` stops the
    #: run with a line naming the fix. An ``eval_step``'s metrics are reported the same way (its ``accuracy`` as
    #: ``eval_accuracy``)
    metrics: Optional[list[Any]] = None
    #: ``{"class": <any torch.optim class name, case-insensitive: "adamw", "RMSprop">, **kwargs}`` (lr =
    #: learning_rate), or a factory ``params -> Optimizer`` (a callable or "module:function"; it sets its own lr).
    #: A factory with a parameter named ``named_parameters`` gets the model's ``(name, parameter)`` pairs there (a
    #: list; names as in the bare model, no ``module.`` prefix), for grouping by name as Hugging Face does:
    #: ``def optimizer(named_parameters): return torch.optim.AdamW([{"params": [p for n, p in named_parameters if
    #: "bias" not in n], "weight_decay": 0.01}, {"params": [p for n, p in named_parameters if "bias" in n],
    #: "weight_decay": 0.0}], lr=1e-3)``; ``def optimizer(params, named_parameters)`` gets both. LBFGS needs a
    #: closure: use it in your own loop or ``distkit.compat.perceptrain``. ``{"class": "muon", **torch.optim.Muon's
    #: keys, "adamw": {**AdamW's keys}, "adamw_names": [regex, ...]}`` (MuLoCo's inner optimizer): Muon (lr =
    #: learning_rate, adjust_lr_fn "match_rms_adamw") on the 2-D matrices, AdamW (lr and weight_decay Muon's unless
    #: given) on the rest and on the 2-D parameters whose names match ``adamw_names`` (default: embeddings and the
    #: output head); ddp, mpi, horovod, fsdp (whole matrices gathered), DeepSpeed ZeRO 0 in fp32 only
    optimizer: Any = field(default_factory=lambda: {"class": "sgd"})
    #: None, ``{"class": "constant"|"linear"|"cosine"|"step"|<torch.optim.lr_scheduler class>, "warmup_steps": N,
    #: ...}`` (``min_lr_ratio`` for cosine/linear; ``step_size``, ``gamma`` for step; a torch class gets the other
    #: keys) or a factory ``(optimizer, total_steps) -> scheduler``. Stepped once per optimizer step, saved in
    #: checkpoints, the same schedule on every engine (DeepSpeed gets the same factory through
    #: ``deepspeed.initialize``; a DeepSpeed ``scheduler`` block as well is refused). ``lr`` is in every
    #: metrics.jsonl line
    lr_scheduler: Any = None
    #: "32" (fp32), "bf16-mixed" (torch.autocast to bfloat16 around forward and loss, CPU or CUDA) or "16-mixed"
    #: (float16 autocast with a GradScaler, CUDA only); on DeepSpeed it selects the config's bf16/fp16 block instead
    #: (a block saying otherwise is refused)
    precision: str = "32"
    #: objects with any of on_train_start(trainer), on_step_end(trainer, metrics) (each log point),
    #: on_eval_end(trainer, metrics), on_checkpoint(trainer, path), on_train_end(trainer, summary); called on every
    #: rank (guard file output with ``trainer.is_main``). ``trainer.request_stop()`` on any rank stops every rank
    #: after the same step (agreed by a MAX all-reduce after each log/eval point's hooks); ``summary.json`` then has
    #: ``stopped_early: true``
    callbacks: list[Any] = field(default_factory=list)
    #: experiment trackers rank 0 writes to, besides metrics.jsonl: any of "tensorboard" (output_dir/tensorboard),
    #: "mlflow" (output_dir/mlflow.db, or MLFLOW_TRACKING_URI), "wandb" (offline under output_dir/wandb unless W&B
    #: is configured), "csv" (output_dir/metrics.csv), and objects with ``log(metrics, step)`` (Accelerate's tracker
    #: methods, or a Lightning logger's). The same records as metrics.jsonl, the config as hyperparameters, the
    #: summary at the end; a resumed run continues the same tracker run. ``pip install 'distkit[trackers]'``
    loggers: list[Any] = field(default_factory=list)
    #: the optimizer's lr (a factory optimizer sets its own)
    learning_rate: float = 0.1
    #: samples per rank per micro-step (like DDP's per-process batch and DeepSpeed's micro batch).
    batch_size: int = 32
    #: passes over the training data (when max_steps is None)
    num_epochs: int = 1
    #: the run length in optimizer steps; when set, the data repeats over as many epochs as it takes (as in HF's
    #: Trainer); None = num_epochs epochs
    max_steps: Optional[int] = None
    #: seed of the model's initialisation and the data order (the same on every rank), 0 to 2**32 - 1
    seed: int = 42
    #: "auto" (CUDA if visible), "cpu" or "cuda"
    device: str = "auto"
    #: "shard" (each rank a disjoint part of every global batch: disjoint slices of one global order, the same at
    #: every world size) or "random_seed_offset" (RETURNN: every rank the whole data, in its own order)
    data_distribution: str = "shard"
    #: micro-steps per optimizer step (gradient accumulation; no communication on the others)
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
    #: unset: start from step 0, but refuse (one line, exit status 2) an output_dir that holds checkpoints.
    #: "auto": continue from output_dir/checkpoints/``latest`` if there is one (every file checked against the
    #: manifest's sha256; a damaged or incomplete ``latest`` falls back to the newest complete checkpoint, saying so;
    #: checkpoints that exist but none complete stop the run; no checkpoints at all: start from step 0). A
    #: checkpoint directory (of any engine, number of ranks or mode). "none": start from step 0, replacing the
    #: earlier run's checkpoints.
    resume: Optional[str] = None
    #: write periodic checkpoints in a background thread: the loop stops only to copy the state to CPU memory
    #: (charlm large, 2 ranks, quiet machine: 0.11 s instead of 0.78 s per checkpoint, 7.4x less,
    #: ``benchmarks/checkpoint_stall.py``); each becomes complete (``latest``) at the next checkpoint; the final one
    #: is always synchronous. ``summary.json`` has, for every run, ``checkpoints``, ``checkpoint_stalls_s`` (seconds
    #: rank 0 was blocked, per checkpoint) and their sum ``checkpoint_stall_s``
    checkpoint_async: bool = False
    #: complete checkpoints kept in output_dir/checkpoints (older ones are deleted once a new one is complete)
    keep_checkpoints: int = 3
    #: SIGTERM or SIGUSR1 (what SLURM and Kubernetes send before they end a job; ``sbatch --signal``) stops every
    #: rank after the same step, at most 3 steps after the signal (agreed by one small MAX all-reduce per step,
    #: in the background, read 2 steps later), writes a checkpoint of that step
    #: and exits with status 75 (``++resume auto`` continues bit-identically; ``distkit sbatch --requeue``
    #: requeues the job on it); a second signal ends the run at once. False: the signals end it at once
    preemption: bool = True
    #: replica groups that survive failures (torchft; param mode): ``{"lighthouse": "http://HOST:29510",
    #: "replica_id": i, "num_replicas": N, "min_replicas": 1}``. Each group is a launch of its own (replica_id
    #: 0 .. N-1, writing to output_dir/group-<i>); inside a group gradients are reduced every step, across groups
    #: the parameters are averaged every param_sync_step steps by the groups alive then (a quorum from the
    #: lighthouse: ``distkit lighthouse``); a (re)started group heals from a live one. ``quorum_timeout_s``
    #: (default 600) bounds the wait for a quorum, ``connect_timeout_s`` (default 30) the wait of a new quorum's
    #: groups for each other to connect (at most distributed.timeout_s), ``token_file`` (default
    #: ~/.distkit/lighthouse.token, which ``distkit lighthouse`` writes) the lighthouse's token that every rank
    #: proves at its gate (None: a lighthouse without a gate), ``late`` (default "heal": a group left out of a sync
    #: heals at its next one, its steps since its last sync replaced; "merge": a sync goes ahead once the groups
    #: that arrived waited the grace window, ``grace_s`` seconds (default 2) or ``grace_fraction`` of the time since
    #: their last sync, and a late group's pseudo-gradient is merged at the next sync it joins, weighted by its
    #: samples; docs/fault_tolerance.md). None = no fault tolerance
    fault_tolerance: Optional[dict[str, Any]] = None
    #: a tqdm bar on rank 0
    progress_bar: bool = True
    #: engine and mode: see the distributed.* keys
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    #: number of local ranks distkit spawns itself (perceptrain's nprocs); ignored under a launcher.
    nprocs: int = 1
    #: task charlm: model size: "small" (0.22M parameters), "medium" (1.8M) or "large" (10.8M)
    charlm_size: str = "small"
    #: task charlm: characters per sample
    charlm_seq_len: int = 64
    #: task charlm: its text: "pydoc" (CPython's ``pydoc_data`` topics, 0.47M characters, last 10 % eval) or
    #: "stdlib" (the running Python's standard-library source, 31.5M characters on 3.11.7, last 1 % eval: long runs
    #: that must not repeat the data)
    charlm_corpus: str = "pydoc"
    #: set by the resolver: the top-level keys the user wrote (not a config key)
    explicit_keys: Optional[frozenset[str]] = field(default=None, metadata={"internal": True})
    #: set by the resolver: one-line notes for rank 0 to print at start (e.g. an engine spelling replaced)
    notes: tuple[str, ...] = field(default=(), metadata={"internal": True})
    #: set by ``distkit train``'s Trainer: the run writes its outputs under ``output_dir``, chosen or not (an own
    #: loop writes there only when the script chose one)
    writes_outputs: bool = field(default=False, metadata={"internal": True})

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict; callables become "module:qualname" strings, other objects their repr.
        (Not ``dataclasses.asdict``: it would deep-copy a dataset given as a value.)"""
        return _jsonable({k: getattr(self, k) for k in TOP_LEVEL_KEYS})


#: RETURNN's ``torch_distributed`` keys -> canonical ``distributed`` keys.
TORCH_DISTRIBUTED_KEYS = {
    "reduce_type": "reduce_type", "param_sync_step": "param_sync_step",
    "param_sync_time_diff": "param_sync_time_diff", "param_sync_fragments": "param_sync_fragments",
    "param_sync_compression": "param_sync_compression", "param_sync_error_feedback": "param_sync_error_feedback",
    "param_sync_topk_density": "param_sync_topk_density", "param_sync_topk_bits": "param_sync_topk_bits",
    "param_sync_topk_chunk": "param_sync_topk_chunk", "param_sync_overlap": "param_sync_overlap",
    "options": "options",
    "backend": "pg_backend", "timeout_sec": "timeout_s", "timeout_s": "timeout_s",
    "sync_on_cpu": None,  # accepted (param mode); on CPU it changes nothing
    "class": None,        # only the default DDP class is supported; checked below
}


#: RETURNN's Horovod keys -> canonical ``distributed`` keys (data_distribution is top level).
HOROVOD_KEYS = {
    "horovod_reduce_type": "reduce_type", "horovod_param_sync_step": "param_sync_step",
    "horovod_param_sync_time_diff": "param_sync_time_diff", "horovod_scale_lr": "scale_lr",
    "horovod_dataset_distribution": "data_distribution", "horovod_avg_grad": "avg_grad",
    "horovod_compression": "compression", "horovod_require": "require_horovod",
}


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
    "torch_distributed",      # RETURNN: selects ddp (options: DDP kwargs, grad only; sync_on_cpu: param only)
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


def _alias_docs() -> dict[str, str]:
    """The comment after each seed spelling in :data:`ALIAS_KEYS` ("" where a line has none)."""
    import inspect
    import re
    import sys

    source = inspect.getsource(sys.modules[__name__])
    block = source[source.index("ALIAS_KEYS = ("):source.index("ALL_KEYS = ")]
    docs: dict[str, str] = {}
    for line in block.splitlines()[1:]:
        code, _, comment = line.partition("#")
        for name in re.findall(r'"(\w+)"', code):
            docs[name] = comment.strip()
    return docs


def keys_markdown(pattern: str = "") -> str:
    """``distkit keys --markdown``: every key (containing ``pattern``) as one Markdown table, then the seed
    spellings as a list; docs/config.md is this text."""

    def cell(text: str) -> str:
        return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")

    lines = ["# Config keys", "",
             "Generated by `distkit keys --markdown` from the `#:` comments in `distkit/config/schema.py`; "
             "do not edit by hand (`.venv/bin/python -m distkit keys --markdown > docs/config.md`).", "",
             "| key | default | meaning |", "|---|---|---|"]
    for key, default, meaning in key_docs():
        if pattern in key:
            shown = default if not callable(default) else getattr(default, "__name__", default)
            lines.append(f"| `{cell(key)}` | `{cell(repr(shown))}` | {cell(meaning)} |")

    aliases = _alias_docs()
    aliases["torch_distributed"] += "; its keys: " + ", ".join(f"`{k}`" for k in TORCH_DISTRIBUTED_KEYS)
    for name, target in HOROVOD_KEYS.items():
        where = target if target == "data_distribution" else f"distributed.{target}"
        aliases[name] = aliases.get(name) or f"RETURNN (Horovod): sets `{where}`"
    names = [a for a in ALIAS_KEYS if pattern in a]
    if names:
        lines += ["", "## Seed spellings", "",
                  "Folded into the keys above (RETURNN, SpeechBrain, perceptrain, DeepSpeed):", ""]
        lines += [f"- `{a}`" + (f": {aliases[a]}" if aliases.get(a) else "") for a in names]
    return "\n".join(lines) + "\n"
