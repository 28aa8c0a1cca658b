"""Typed schema of a training run, validated before anything is built.

Hydra composes YAML from conf/; `load_run_config` checks it against these dataclasses
(types through OmegaConf's structured merge, ranges and cross-field rules in
`__post_init__`) and turns every problem into one `ConfigError` line naming the key.
Sweeps send trials the same tree as a plain dict; `load_run_config` accepts that too.
"""

from __future__ import annotations

import difflib
import glob
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from sweeper.config.errors import ConfigError

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


def _positive(key: str, value: float | None) -> None:
    _require(value is None or value > 0, f"{key} must be > 0, got {value}")


def _fraction(key: str, value: float) -> None:
    _require(0.0 <= value <= 1.0, f"{key} must be in [0, 1], got {value}")


@dataclass
class ModelConfig:
    depth: int = 4
    aspect_ratio: int = 64
    d_model: int | None = None
    head_dim: int = 64
    seq_len: int = 256
    vocab_size: int | None = None
    softcap: float = 15.0

    def __post_init__(self) -> None:
        _require(self.depth >= 1, f"model.depth must be >= 1, got {self.depth}")
        _positive("model.aspect_ratio", self.aspect_ratio)
        _positive("model.d_model", self.d_model)
        _positive("model.head_dim", self.head_dim)
        _require(self.seq_len >= 2, f"model.seq_len must be >= 2, got {self.seq_len}")
        _positive("model.vocab_size", self.vocab_size)
        _require(self.softcap >= 0, f"model.softcap must be >= 0, got {self.softcap}")
        width = self.width
        _require(
            width % self.head_dim == 0,
            f"model.d_model ({width}) must be a multiple of model.head_dim ({self.head_dim})",
        )
        _require(self.head_dim % 2 == 0, f"model.head_dim must be even (RoPE), got {self.head_dim}")

    @property
    def width(self) -> int:
        """d_model: fixed by `d_model`, else derived from depth (width follows depth)."""
        return self.d_model if self.d_model else self.depth * self.aspect_ratio


@dataclass
class OptimizerConfig:
    name: str = "muon_adamw"
    matrix_lr: float = 0.02
    embedding_lr: float = 0.2
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.02
    lr: float = 0.001
    weight_decay: float = 0.0
    weight_decay_schedule: str = "constant"
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    adam_eps: float = 1e-10
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85
    muon_momentum_warmup: int = 300

    def __post_init__(self) -> None:
        _require(
            self.name in OPTIMIZERS,
            f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}",
        )
        for key in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "lr"):
            value = getattr(self, key)
            _require(
                value > 0 and math.isfinite(value), f"optimizer.{key} must be > 0, got {value}"
            )
        _require(
            self.weight_decay >= 0,
            f"optimizer.weight_decay must be >= 0, got {self.weight_decay}",
        )
        _require(
            self.weight_decay_schedule in WEIGHT_DECAY_SCHEDULES,
            f"optimizer.weight_decay_schedule must be one of {', '.join(WEIGHT_DECAY_SCHEDULES)}, "
            f"got {self.weight_decay_schedule!r}",
        )
        for key in ("adam_beta1", "adam_beta2", "muon_momentum", "muon_momentum_start"):
            value = getattr(self, key)
            _require(0 <= value < 1, f"optimizer.{key} must be in [0, 1), got {value}")
        _positive("optimizer.adam_eps", self.adam_eps)
        _require(
            self.muon_momentum_warmup >= 0,
            f"optimizer.muon_momentum_warmup must be >= 0, got {self.muon_momentum_warmup}",
        )


@dataclass
class SchedulerConfig:
    name: str = "wsd"
    warmup_ratio: float = 0.0
    warmdown_ratio: float = 0.4
    final_lr_frac: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.name in SCHEDULES,
            f"scheduler.name must be one of {', '.join(SCHEDULES)}, got {self.name!r}",
        )
        _fraction("scheduler.warmup_ratio", self.warmup_ratio)
        _fraction("scheduler.warmdown_ratio", self.warmdown_ratio)
        _fraction("scheduler.final_lr_frac", self.final_lr_frac)
        if self.name == "wsd":
            _require(
                self.warmup_ratio + self.warmdown_ratio <= 1.0,
                "scheduler.warmup_ratio + scheduler.warmdown_ratio must be <= 1, got "
                f"{self.warmup_ratio} + {self.warmdown_ratio}",
            )


@dataclass
class DataConfig:
    name: str = "stdlib"
    path: str | None = None
    val_path: str | None = None
    vocab_size: int = 256
    bytes_per_token: float | None = 1.0
    val_every_n_files: int = 50

    def __post_init__(self) -> None:
        _require(
            self.name in DATASETS,
            f"data.name must be one of {', '.join(DATASETS)}, got {self.name!r}",
        )
        _require(self.vocab_size >= 2, f"data.vocab_size must be >= 2, got {self.vocab_size}")
        _positive("data.bytes_per_token", self.bytes_per_token)
        _require(
            self.val_every_n_files >= 2,
            f"data.val_every_n_files must be >= 2, got {self.val_every_n_files}",
        )
        if self.name == "shards":
            _require(bool(self.path), "data.path must be set for data=shards")
            _require(bool(glob.glob(self.path)), f"data.path matches no file: {self.path}")
            if self.val_path:
                _require(
                    bool(glob.glob(self.val_path)),
                    f"data.val_path matches no file: {self.val_path}",
                )
        if self.name == "stdlib":
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
    device: str = "auto"
    dtype: str = "auto"
    compile: str = "auto"
    device_batch_size: int = 16
    total_batch_size: int = 8192
    max_steps: int | None = None
    budget_tokens: float | None = 600_000
    budget_flops: float | None = None
    tokens_per_param: float | None = None
    eval_every: int = 25
    num_evals: int | None = None
    eval_tokens: int = 32768
    log_every: int = 5
    grad_clip: float = 1.0
    max_loss: float | None = None
    max_loss_patience: int = 10
    seed: int = 0
    workers: int = 1
    dist_timeout_s: int = 60
    threads: int | None = None
    checkpoint_every_eval: bool = False
    resume: bool = False  # a single run: go on from the checkpoint in hydra.run.dir
    nan_at_step: int | None = None  # fault injection: see conf/trainer/cpu.yaml
    # set by a sweep with sweep.rung_cooldown: fractions of the budget where its scheduler
    # ranks trials, and the length of the cooled-down fork evaluated there (train.py)
    rungs: list[float] = field(default_factory=list)
    rung_cooldown: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.device in DEVICES,
            f"trainer.device must be one of {', '.join(DEVICES)}, got {self.device!r}",
        )
        _require(
            self.dtype in DTYPES,
            f"trainer.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}",
        )
        self.compile = str(self.compile).lower()
        _require(
            self.compile in ("auto", "true", "false"),
            f"trainer.compile must be auto, true or false, got {self.compile!r}",
        )
        for key in ("device_batch_size", "total_batch_size", "eval_every", "eval_tokens"):
            value = getattr(self, key)
            _require(value >= 1, f"trainer.{key} must be >= 1, got {value}")
        _positive("trainer.num_evals", self.num_evals)
        _require(self.log_every >= 1, f"trainer.log_every must be >= 1, got {self.log_every}")
        _require(self.workers >= 1, f"trainer.workers must be >= 1, got {self.workers}")
        _positive("trainer.dist_timeout_s", self.dist_timeout_s)
        _require(self.grad_clip >= 0, f"trainer.grad_clip must be >= 0, got {self.grad_clip}")
        _positive("trainer.max_loss", self.max_loss)
        _require(
            self.max_loss_patience >= 1,
            f"trainer.max_loss_patience must be >= 1, got {self.max_loss_patience}",
        )
        _positive("trainer.threads", self.threads)
        _require(  # torch.manual_seed takes 64 bits
            0 <= self.seed < 2**64, f"trainer.seed must be in [0, 2^64), got {self.seed}"
        )
        _positive("trainer.nan_at_step", self.nan_at_step)
        _require(
            0 <= self.rung_cooldown <= 1,
            f"trainer.rung_cooldown must be in [0, 1], got {self.rung_cooldown}",
        )
        for rung in self.rungs:
            _require(0 < rung < 1, f"trainer.rungs must lie in (0, 1), got {rung}")
        budgets = [k for k in BUDGET_KEYS if getattr(self, k) is not None]
        _require(
            len(budgets) == 1,
            f"set exactly one of trainer.{', trainer.'.join(BUDGET_KEYS)}; got "
            f"{', '.join(budgets) if budgets else 'none'}",
        )
        for key in BUDGET_KEYS:
            _positive(f"trainer.{key}", getattr(self, key))


@dataclass
class RunConfig:
    """Everything one training run needs; the trial config of a sweep has this shape."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        # inf passes every range check above (inf > 0) and fails deep inside training
        for section in RUN_SECTIONS:
            for key, value in asdict(getattr(self, section)).items():
                _require(
                    not isinstance(value, float) or math.isfinite(value),
                    f"{section}.{key} must be a finite number, got {value}",
                )
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
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(tree, RunConfig):
        return tree
    container = OmegaConf.to_container(tree, resolve=True) if OmegaConf.is_config(tree) else tree
    sections = {k: container[k] for k in RUN_SECTIONS if k in container}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), sections)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error)) from None


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
    address: str | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265

    def __post_init__(self) -> None:
        _positive("ray.num_cpus", self.num_cpus)
        for name, value in (("ray.num_cpus", self.num_cpus), ("ray.num_gpus", self.num_gpus)):
            _require(  # Ray's own check comes after the MLflow run is made, and blames address
                value is None or (math.isfinite(value) and value == int(value)),
                f"{name} must be a whole number (Ray counts whole devices), got {value}",
            )
        _require(
            self.num_gpus is None or self.num_gpus >= 0,
            f"ray.num_gpus must be >= 0, got {self.num_gpus}",
        )
        _require(
            1 <= self.dashboard_port <= 65535,
            f"ray.dashboard_port must be a port in [1, 65535], got {self.dashboard_port}",
        )


@dataclass
class MlflowSection:
    tracking_uri: str | None = None
    experiment: str = "sweeper"
    enabled: bool = True


@dataclass
class FitSection:
    target_flops: float | None = None
    bootstrap: int = 200

    def __post_init__(self) -> None:
        _require(
            self.target_flops is None
            or (self.target_flops > 0 and math.isfinite(self.target_flops)),
            f"fit.target_flops must be a positive number or null, got {self.target_flops}",
        )
        _require(self.bootstrap >= 0, f"fit.bootstrap must be >= 0, got {self.bootstrap}")


PLATFORM_SECTIONS = {"ray": RaySection, "mlflow": MlflowSection, "fit": FitSection}
# every top-level key of a composed config that sweeper's own training reads: anything else
# is a typo (`+foo=1`). A user's own trainable gets the whole config, its own sections too.
ROOT_KEYS = (*RUN_SECTIONS, *PLATFORM_SECTIONS, "trainable", "sweep", "hydra")
BUILTIN_TRAINABLE = "sweeper.train.train"


def check_platform_sections(tree: Any) -> None:
    """The ray, mlflow and fit sections and the root's keys, checked like a run's."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(tree, resolve=True) if OmegaConf.is_config(tree) else tree
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

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

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
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except ConfigError:
        raise
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error, prefix, known)) from None
