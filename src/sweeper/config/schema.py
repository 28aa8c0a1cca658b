"""Typed schema of a training run, validated before anything is built.

Hydra composes YAML from conf/; `load_run_config` checks it against these dataclasses
(types through OmegaConf's structured merge, ranges and cross-field rules in
`__post_init__`) and turns every problem into one `ConfigError` line naming the key.
Sweeps send trials the same tree as a plain dict; `load_run_config` accepts that too.
"""

from __future__ import annotations

import difflib
import glob
from dataclasses import asdict, dataclass, field
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.fields import bounded, check_fields, choice

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float32")
OPTIMIZERS = ("muon_adamw", "adamw")
# the optimizer.* learning rates each optimizer reads (optim.build_optimizer). Both optimizer
# files carry all of them, so that `optimizer=adamw` switches with nothing else to edit.
OPTIMIZER_LRS = {
    "muon_adamw": ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr"),
    "adamw": ("lr",),
}
# the keys of the optimizer section each optimizer leaves unread (its conf file says
# "unused by this optimizer"): a value set or searched there would change nothing
UNREAD_OPTIMIZER_KEYS = {
    "muon_adamw": ("lr",),
    "adamw": (
        *OPTIMIZER_LRS["muon_adamw"],
        "muon_momentum",
        "muon_momentum_start",
        "muon_momentum_warmup",
    ),
}
SCHEDULES = ("wsd", "cosine", "constant")
WEIGHT_DECAY_SCHEDULES = ("constant", "linear")
DATASETS = ("stdlib", "shards")
BUDGET_KEYS = ("max_steps", "budget_tokens", "budget_flops", "tokens_per_param")


def micro_batch_dividing(total: int, sequence_tokens: int, device_batch: int) -> int | None:
    """The largest micro-batch (sequences) up to `device_batch` that divides a batch of
    `total` tokens into whole micro-batches of `sequence_tokens` per sequence (seq_len x
    workers); None where no whole number of sequences makes the batch."""
    if total <= 0 or total % sequence_tokens:
        return None
    sequences = total // sequence_tokens
    return next((d for d in range(min(device_batch, sequences), 0, -1) if sequences % d == 0), None)


def _smaller_micro_batch(total: int, sequence_tokens: int, device_batch: int) -> str:
    """'; trainer.device_batch_size=N makes it one' where a smaller micro-batch divides the
    batch (a batch below lr_bs's 16 x 256 tokens), else nothing."""
    fits = micro_batch_dividing(total, sequence_tokens, device_batch)
    return f"; trainer.device_batch_size={fits} makes it one" if fits else ""


def check_optimizer_reads(optimizer: str, key: str, where: str) -> None:
    """Refuses `key` (optimizer.X, set or searched at `where`) if `optimizer` leaves it
    unread: every run would train as if it were not there."""
    name = key.removeprefix("optimizer.")
    if not key.startswith("optimizer.") or name not in UNREAD_OPTIMIZER_KEYS.get(optimizer, ()):
        return
    reads = ", ".join(f"optimizer.{lr}" for lr in OPTIMIZER_LRS[optimizer])
    raise ConfigError(
        f"{where}: optimizer={optimizer} does not read {key} (its LR keys: {reads}); "
        "drop it or choose the optimizer that reads it"
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class ModelConfig:
    depth: int = bounded(4, ge=1)
    aspect_ratio: int = bounded(64, gt=0)  # d_model = depth * aspect_ratio unless d_model is set
    d_model: int | None = bounded(None, gt=0)
    head_dim: int = bounded(64, gt=0)
    seq_len: int = bounded(256, ge=2)
    vocab_size: int | None = bounded(None, gt=0)  # null: data.vocab_size
    softcap: float = bounded(15.0, ge=0)  # tanh soft-cap of the logits (0: none)

    def __post_init__(self) -> None:
        _require(
            self.width % self.head_dim == 0,
            f"model.d_model ({self.width}) must be a multiple of model.head_dim ({self.head_dim})",
        )
        _require(self.head_dim % 2 == 0, f"model.head_dim must be even (RoPE), got {self.head_dim}")

    @property
    def width(self) -> int:
        """d_model: fixed by `d_model`, else derived from depth (width follows depth)."""
        return self.d_model if self.d_model else self.depth * self.aspect_ratio


@dataclass
class OptimizerConfig:
    name: str = choice("muon_adamw", OPTIMIZERS)
    matrix_lr: float = bounded(0.02, gt=0)
    embedding_lr: float = bounded(0.2, gt=0)
    unembedding_lr: float = bounded(0.004, gt=0)
    scalar_lr: float = bounded(0.02, gt=0)
    lr: float = bounded(0.001, gt=0)  # adamw's only LR
    weight_decay: float = bounded(0.0, ge=0)
    weight_decay_schedule: str = choice("constant", WEIGHT_DECAY_SCHEDULES)
    adam_beta1: float = bounded(0.8, ge=0, lt=1)
    adam_beta2: float = bounded(0.95, ge=0, lt=1)
    adam_eps: float = bounded(1e-10, gt=0)
    muon_momentum: float = bounded(0.95, ge=0, lt=1)
    muon_momentum_start: float = bounded(0.85, ge=0, lt=1)
    muon_momentum_warmup: int = bounded(300, ge=0)


@dataclass
class SchedulerConfig:
    name: str = choice("wsd", SCHEDULES)
    warmup_ratio: float = bounded(0.0, ge=0, le=1)
    warmdown_ratio: float = bounded(0.4, ge=0, le=1)
    final_lr_frac: float = bounded(0.0, ge=0, le=1)

    def __post_init__(self) -> None:
        if self.name == "wsd":
            _require(
                self.warmup_ratio + self.warmdown_ratio <= 1.0,
                "scheduler.warmup_ratio + scheduler.warmdown_ratio must be <= 1, got "
                f"{self.warmup_ratio} + {self.warmdown_ratio}",
            )


@dataclass
class DataConfig:
    name: str = choice("stdlib", DATASETS)
    path: str | None = None
    val_path: str | None = None
    vocab_size: int = bounded(256, ge=2)
    bytes_per_token: float | None = bounded(1.0, gt=0)
    val_every_n_files: int = bounded(50, ge=2)

    def __post_init__(self) -> None:
        if self.name == "shards":
            _require(bool(self.path), "data.path must be set for data=shards")
            _require(bool(glob.glob(self.path)), f"data.path matches no file: {self.path}")
            if self.val_path:
                _require(
                    bool(glob.glob(self.val_path)),
                    f"data.val_path matches no file: {self.val_path}",
                )
            return
        for key in ("path", "val_path"):  # the run would train on the stdlib unseen
            value = getattr(self, key)
            _require(
                value is None,
                f"data.{key}={value}: the stdlib corpus reads no files of yours; add "
                "data=shards to train on them",
            )
        _require(
            self.vocab_size == 256,
            f"data.vocab_size must be 256 for the byte-level stdlib corpus, got {self.vocab_size}",
        )
        _require(  # one token is one byte: any other value would scale val_bpb
            self.bytes_per_token == 1.0,
            "data.bytes_per_token must be 1 for the byte-level stdlib corpus, got "
            f"{self.bytes_per_token}",
        )


@dataclass
class TrainerConfig:
    device: str = choice("auto", DEVICES)
    dtype: str = choice("auto", DTYPES)
    compile: str = "auto"  # auto | true | false (a YAML bool arrives as "True")
    device_batch_size: int = bounded(16, ge=1)  # sequences per micro-batch
    total_batch_size: int = bounded(8192, ge=1)  # tokens per optimizer step
    max_steps: int | None = bounded(None, gt=0)
    budget_tokens: float | None = bounded(600_000, gt=0)
    budget_flops: float | None = bounded(None, gt=0)
    tokens_per_param: float | None = bounded(None, gt=0)
    eval_every: int = bounded(25, ge=1)
    num_evals: int | None = bounded(None, gt=0)
    eval_tokens: int = bounded(32768, ge=1)
    log_every: int = bounded(5, ge=1)
    grad_clip: float = bounded(1.0, ge=0)
    max_loss: float | None = bounded(None, gt=0)
    max_loss_patience: int = bounded(10, ge=1)
    seed: int = 0
    workers: int = bounded(1, ge=1)  # DDP ranks
    dist_timeout_s: int = bounded(60, gt=0)
    threads: int | None = bounded(None, gt=0)
    checkpoint_every_eval: bool = False
    resume: bool = False  # a single run: go on from the checkpoint in hydra.run.dir
    nan_at_step: int | None = bounded(None, gt=0)  # fault injection: see conf/trainer/cpu.yaml
    # set by a sweep with sweep.rung_cooldown: fractions of the budget where its scheduler
    # ranks trials, and the length of the cooled-down fork evaluated there (train/loop.py)
    rungs: list[float] = field(default_factory=list)
    rung_cooldown: float = bounded(0.0, ge=0, le=1)

    def __post_init__(self) -> None:
        self.compile = str(self.compile).lower()
        _require(
            self.compile in ("auto", "true", "false"),
            f"trainer.compile must be auto, true or false, got {self.compile!r}",
        )
        _require(  # torch.manual_seed takes 64 bits
            0 <= self.seed < 2**64, f"trainer.seed must be in [0, 2^64), got {self.seed}"
        )
        for rung in self.rungs:
            _require(0 < rung < 1, f"trainer.rungs must lie in (0, 1), got {rung}")
        budgets = [k for k in BUDGET_KEYS if getattr(self, k) is not None]
        _require(
            len(budgets) == 1,
            f"set exactly one of trainer.{', trainer.'.join(BUDGET_KEYS)}; got "
            f"{', '.join(budgets) if budgets else 'none'}",
        )


@dataclass
class RunConfig:
    """Everything one training run needs; the trial config of a sweep has this shape."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        t, m = self.trainer, self.model
        micro = t.device_batch_size * m.seq_len * t.workers
        _require(
            t.total_batch_size % micro == 0,
            "trainer.total_batch_size must be a multiple of trainer.device_batch_size * "
            f"model.seq_len * trainer.workers = {micro}, got {t.total_batch_size}"
            + _smaller_micro_batch(t.total_batch_size, m.seq_len * t.workers, t.device_batch_size),
        )
        if m.vocab_size is None:
            m.vocab_size = self.data.vocab_size
        _require(
            m.vocab_size >= self.data.vocab_size,
            f"model.vocab_size ({m.vocab_size}) must be >= data.vocab_size ({self.data.vocab_size})",
        )

    @property
    def grad_accum_steps(self) -> int:
        t = self.trainer
        return t.total_batch_size // (t.device_batch_size * self.model.seq_len * t.workers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


RUN_SECTIONS = ("model", "optimizer", "scheduler", "data", "trainer")


def load_run_config(tree: Any) -> RunConfig:
    """Validate a composed config (DictConfig or plain dict) into a RunConfig.

    Keys outside the five run sections (ray, mlflow, sweep, ...) are ignored here;
    unknown keys inside a section, wrong types and out-of-range values raise ConfigError.
    """
    if isinstance(tree, RunConfig):
        return tree
    container = plain(tree)
    return _merged(RunConfig, {k: container[k] for k in RUN_SECTIONS if k in container}, "")


def plain(tree: Any) -> Any:
    """A DictConfig as plain, resolved values; anything else as it is."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(tree, resolve=True) if OmegaConf.is_config(tree) else tree


def _merged(schema: type, values: dict, prefix: str, known: Any = ()) -> Any:
    """`values` merged into the dataclass `schema`: types through OmegaConf, then the
    declared choices and ranges (check_fields) and __post_init__; each error one line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        check_fields(schema, OmegaConf.to_container(merged), prefix)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error, prefix, known)) from None


def _omegaconf_message(error: Exception, prefix: str = "", known: Any = ()) -> str:
    """One line from OmegaConf's multi-line validation errors, naming the key (under
    `prefix`, with a did-you-mean among `known` keys for a typo)."""
    key = getattr(error, "full_key", None)
    key = f"{prefix}{key}" if key else None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "not in struct" in first or "Key '" in first and "not" in first:
        if not key:
            return first
        close = difflib.get_close_matches(key.rpartition(".")[2], list(known), n=1)
        hint = f": did you mean {key.rpartition('.')[0]}.{close[0]}?" if close else ""
        return f"unknown config key: {key}{hint}"
    if isinstance(error.__cause__, ConfigError):
        return str(error.__cause__)
    return f"{key}: {first}" if key else first


# --- the platform's own sections: typed too, so a typo or a bad value there is one line ---
@dataclass
class RaySection:
    address: str | None = None  # null: start a local cluster; "auto" or ray://host:port
    num_cpus: float | None = bounded(None, gt=0)
    num_gpus: float | None = bounded(None, ge=0)
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = bounded(8265, ge=1, le=65535)

    def __post_init__(self) -> None:
        for name, value in (("ray.num_cpus", self.num_cpus), ("ray.num_gpus", self.num_gpus)):
            _require(  # Ray's own check comes after the MLflow run is made, and blames address
                value is None or value == int(value),
                f"{name} must be a whole number (Ray counts whole devices), got {value}",
            )


@dataclass
class MlflowSection:
    tracking_uri: str | None = None
    experiment: str = "sweeper"
    enabled: bool = True

    def __post_init__(self) -> None:
        _require(  # MLflow would log under its Default experiment without a word
            bool(self.experiment.strip()),
            "mlflow.experiment is empty; name the experiment the runs are logged under",
        )


@dataclass
class FitSection:
    target_flops: float | None = bounded(None, gt=0)
    bootstrap: int = bounded(200, ge=0)


PLATFORM_SECTIONS = {"ray": RaySection, "mlflow": MlflowSection, "fit": FitSection}
# every top-level key of a composed config that sweeper's own training reads: anything else
# is a typo (`+foo=1`). A user's own trainable gets the whole config, its own sections too.
NONEMPTY_DIR_KEY = "allow_nonempty_dir"  # true: write into a dir that holds others' files
ROOT_KEYS = (*RUN_SECTIONS, *PLATFORM_SECTIONS, "trainable", "sweep", "hydra", NONEMPTY_DIR_KEY)
BUILTIN_TRAINABLE = "sweeper.train.train"


def check_platform_sections(tree: Any) -> None:
    """The ray, mlflow and fit sections and the root's keys, checked like a run's."""
    container = plain(tree)
    for name in ("trainable", *PLATFORM_SECTIONS):
        _require(
            not (name in container and container[name] is None),
            f"{name}=null: {name} is a section; set its keys ({name}.KEY=VALUE) instead",
        )
    own_training = (container.get("trainable") or {}).get("_target_") == BUILTIN_TRAINABLE
    for key in container if own_training else ():
        close = difflib.get_close_matches(str(key), ROOT_KEYS, n=1)
        hint = f": did you mean {close[0]}?" if close else ""
        _require(key in ROOT_KEYS, f"unknown config key: {key}{hint}")
    for name, schema in PLATFORM_SECTIONS.items():
        if container.get(name) is not None:
            typed(schema, container[name], f"{name}.")


def typed(schema: type, values: Any, prefix: str) -> Any:
    """A plain mapping as the dataclass `schema` (types through OmegaConf, ranges in its
    __post_init__); every mistake one ConfigError naming the key under `prefix`, with a
    did-you-mean for a typo."""
    from dataclasses import MISSING, fields, is_dataclass

    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.')} must be a mapping of keys, got {values!r}")
    known = []
    for spec_field in fields(schema):
        known.append(spec_field.name)
        value, kind = values.get(spec_field.name), spec_field.default_factory
        if is_dataclass(kind):
            known += [f.name for f in fields(kind)]
        if value is None or kind is MISSING:
            continue
        # OmegaConf's own error names no key when a mapping meets a list
        if kind is list and not isinstance(value, list):
            raise ConfigError(f"{prefix}{spec_field.name} must be a list, got {value!r}")
        if kind is not list and not isinstance(value, dict):
            raise ConfigError(f"{prefix}{spec_field.name} must be a mapping, got {value!r}")
    return _merged(schema, values, prefix, known)
