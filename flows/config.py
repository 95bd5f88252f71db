"""The pipeline's one typed config: a model per stage, composed. It is the flow's parameter.

Loaded from defaults, then a YAML file, then ``key=value`` overrides (dotted keys, YAML values).
Every mistake is a ``ConfigError`` that names the field, the value and the fix, raised before
any model is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from storage.store import reject_credentials

from tasks.common.model import ModelConfig
from tasks.common.tracking import TrackingConfig
from tasks.data.config import DataConfig
from tasks.ppo.config import PPOConfig, resolve_placement
from tasks.rm.config import RewardConfig
from tasks.sft.config import SFTConfig

STAGES = ("data", "sft", "rm", "ppo")


class ConfigError(ValueError):
    """A config value is wrong; the message names the field, the value and the fix."""


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str = Field("file://./artifacts", description="Artifact store root: file://, memory://, s3://bucket/prefix, gcs://... (any fsspec protocol).")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options, e.g. {client_kwargs: {endpoint_url: ...}}. Credentials come from the environment (AWS_ACCESS_KEY_ID, ...), never from here.")

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, v: dict) -> dict:
        return reject_credentials("store.storage_options", v)

    def resolved_uri(self) -> str:
        """file:// URIs relative to the working directory become absolute (Ray workers move)."""
        if self.uri.startswith("file://") and not self.uri.startswith("file:///"):
            return "file://" + os.path.abspath(self.uri[len("file://"):])
        if "://" not in self.uri:
            return "file://" + os.path.abspath(self.uri)
        return self.uri


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="Ray cluster address ('ray://host:10001', 'auto', host:port). None: $RAY_ADDRESS, else a private local Ray started for the run (a cluster running on this machine is used only with 'auto' or its address).")
    num_cpus: int | None = Field(None, gt=0, description="Logical CPUs of a local Ray (None: at least 8, so role actors fit on a laptop).")
    num_gpus: int | None = Field(None, ge=0, description="GPUs of a local Ray (None: what torch sees).")
    dashboard: bool = Field(False, description="Start the Ray dashboard of a local Ray (bound to dashboard_host).")
    dashboard_host: str = Field("127.0.0.1", description="Where a local Ray dashboard listens.")


class StageResources(BaseModel):
    """What the Prefect task of one stage asks Ray for, and how it retries."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(1.0, ge=0.0, description="CPUs for the stage's Ray task.")
    num_gpus: float | None = Field(None, ge=0.0, description="GPUs for the stage's Ray task (PPO's role actors ask for their own). None: chosen for the GPUs there are (`resolve_resources`): sft and rm 0.5 each on one GPU (side by side), 1 each on two or more, 0 on CPU, with num_workers > 1 (the workers ask for their own) or device 'cpu'; data and ppo 0.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources.")
    retries: int = Field(1, ge=0, description="Prefect retries of the stage.")
    retry_delay_s: float = Field(2.0, ge=0.0, description="First retry delay; doubles each retry (backoff).")


class PipelineConfig(BaseModel):
    """data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(42, description="Seed of data splits, init and sampling.")
    store: StoreConfig = Field(default_factory=StoreConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rm: RewardConfig = Field(default_factory=RewardConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    resources: dict[str, StageResources] = Field(
        default_factory=lambda: {s: StageResources() for s in STAGES},
        description="Per-stage Ray resources and retries, keyed by data/sft/rm/ppo.",
    )
    refresh: list[str] = Field(default_factory=list, description="Stages to rebuild even when a cached artifact exists (e.g. ['sft']).")

    @field_validator("resources")
    @classmethod
    def _known_stages(cls, v: dict) -> dict:
        unknown = sorted(set(v) - set(STAGES))
        if unknown:
            raise ValueError(f"resources has unknown stages {unknown}; stages are {list(STAGES)}")
        return {s: v.get(s, StageResources()) for s in STAGES}

    @field_validator("refresh")
    @classmethod
    def _known_refresh(cls, v: list) -> list:
        unknown = sorted(set(v) - set(STAGES) - {"all"})
        if unknown:
            raise ValueError(f"refresh has unknown stages {unknown}; use some of {list(STAGES)} or 'all'")
        return v


def local_gpus(ray: RayConfig) -> int | None:
    """GPUs a local Ray gets (``ray.num_gpus``, else what torch sees); None when the run connects
    to a cluster (``ray.address`` / $RAY_ADDRESS, ``auto``), whose GPUs are known once connected."""
    from flows.runtime import ray_address

    if ray_address(ray) != "local":
        return None
    if ray.num_gpus is not None:
        return ray.num_gpus
    if not any(next(Path("/dev").glob(p), None) for p in ("nvidia[0-9]*", "kfd", "dxg")):
        return 0  # no NVIDIA, ROCm or WSL GPU device: torch would see none, and importing it costs seconds
    import torch

    return torch.cuda.device_count()


def resolve_resources(cfg: PipelineConfig, gpus: int | None) -> PipelineConfig:
    """``cfg`` with every unset GPU request chosen for ``gpus`` GPUs (a pure function; what the
    config writes is kept): the stages' Ray tasks (``StageResources.num_gpus``) and PPO's roles
    (``tasks.ppo.config.resolve_placement``). ``gpus`` None (a cluster): the stages' tasks ask for
    none and PPO's roles are resolved by ``train_ppo`` against the cluster's GPU total."""
    resources = {}
    for stage, r in cfg.resources.items():
        if r.num_gpus is None:
            stage_cfg = getattr(cfg, stage, None)
            trains_here = stage in ("sft", "rm") and stage_cfg.num_workers == 1 and stage_cfg.device != "cpu"
            share = 0.0 if not gpus or not trains_here else 1.0 if gpus >= 2 else 0.5
            r = r.model_copy(update={"num_gpus": share})
        resources[stage] = r
    ppo = cfg.ppo if gpus is None else resolve_placement(cfg.ppo, gpus)
    return cfg.model_copy(update={"resources": resources, "ppo": ppo})


def describe_resources(cfg: PipelineConfig, gpus: int | None) -> str:
    """One line: where each stage's Ray task and PPO's roles run (``cfg`` resolved)."""
    stages = ", ".join(f"{s} {r.num_gpus or 0:g} GPU" for s, r in cfg.resources.items())
    p = cfg.ppo
    roles = "resolved on the cluster" if p.actor.gpus_per_worker is None else ", ".join(
        f"{r} {p.role(r).num_workers}x{p.role(r).gpus_per_worker:g}" for r in p.started_roles) + f" (colocate={p.colocate})"
    where = "a cluster" if gpus is None else f"{gpus} local GPU(s)"
    return f"placement for {where}: {stages}; ppo roles {roles}; reference {p.reference}"


def format_validation_error(err: ValidationError, data: dict | None = None) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in e["loc"][:-1])
            lines.append(f"`{field}` is not a known setting{f' of `{parent}`' if parent else ''}: remove it or fix its spelling (see `rlhf config`)")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            shown = "" if isinstance(value, dict) else f" ({value!r})"
            lines.append(f"`{field}`{shown}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is a value, not a section")
    node[parts[-1]] = value


def parse_overrides(items: Iterable[str]) -> dict:
    data: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value: write e.g. --set sft.lr=1e-4")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(data, key.strip(), value)
    return data


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), base: dict | None = None) -> PipelineConfig:
    data: dict = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"--config {str(path)!r}: no such file")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {str(path)!r} must hold a mapping of sections (seed, store, model, sft, ...)")
        data = _merge(data, loaded)
    data = _merge(data, parse_overrides(overrides))
    return validate_config(data)


def validate_config(data: dict | PipelineConfig) -> PipelineConfig:
    if isinstance(data, PipelineConfig):
        return data
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
