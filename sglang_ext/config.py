"""The sparse decode settings: CLI flags, validation and the config object the backend reads.

Flags are parsed as strings and validated here (not by argparse ``type=``) so that every bad
value stops start-up with one line that names the flag, instead of argparse's usage dump of
SGLang's several hundred flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from sglang_ext.selection.reference import METHODS

BACKEND_NAME = "sglang_ext"  # --attention-backend / --decode-attention-backend value
DENSE_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
IMPLS = ("auto", "reference", "triton")
ENV_CONFIG = "SGLANG_EXT_CONFIG"  # JSON fallback for sgl.Engine(...), which rejects unknown kwargs


class ConfigError(ValueError):
    """A bad sparse setting; its message is one line that names the flag."""


@dataclass(frozen=True)
class SparseConfig:
    method: str = "two_level"
    budget: int = 2048
    block_size: int = 16
    candidate_blocks: int = 0  # 0 = auto: twice the blocks the token budget needs
    sink: int = 16
    window: int = 64
    label_channels: int = 16
    label_config: Optional[str] = None
    dense_backend: str = "auto"
    impl: str = "auto"

    @property
    def effective_candidate_blocks(self) -> int:
        if self.candidate_blocks > 0:
            return self.candidate_blocks
        middle = max(self.budget - self.sink - self.window, 0)
        return max(1, 2 * -(-middle // self.block_size))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


# (field, flag, metavar, help). Defaults come from SparseConfig.
_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("method", "--sparse-method", "{" + ",".join(METHODS) + "}",
     "Sparse decode method: quest (top blocks by key min/max bound), ds (top tokens by "
     "label channels), two_level (blocks filtered by the bound, then tokens by labels)."),
    ("budget", "--sparse-budget", "TOKENS",
     "Tokens attended per kv head at each decode step, sink and window included; contexts "
     "within the budget decode densely."),
    ("block_size", "--sparse-block-size", "TOKENS",
     "Tokens per block summarised by key min/max (a power of two)."),
    ("candidate_blocks", "--sparse-candidate-blocks", "BLOCKS",
     "two_level: blocks kept by the block filter before token selection (0 = twice what the "
     "budget needs)."),
    ("sink", "--sparse-sink", "TOKENS", "First tokens of the context that are always attended."),
    ("window", "--sparse-window", "TOKENS",
     "Most recent tokens (the current one included) that are always attended."),
    ("label_channels", "--sparse-label-channels", "CHANNELS",
     "Channels per kv head used for token scores (taken from --sparse-label-config)."),
    ("label_config", "--sparse-label-config", "PATH",
     "Calibrated heavy channels (python -m sglang_ext.selection.calibrate); without it token "
     "scores use every channel."),
    ("dense_backend", "--sparse-dense-backend", "{" + ",".join(DENSE_BACKENDS) + "}",
     "SGLang backend used for prefill/extend (auto: torch_native on CPU, triton on CUDA)."),
    ("impl", "--sparse-impl", "{" + ",".join(IMPLS) + "}",
     "Decode implementation: reference (plain torch, per request; CPU default) or triton "
     "(batched kernels, CUDA graphs; CUDA default)."),
)
_FIELD_BY_FLAG = {flag: field for field, flag, _, _ in _FLAGS}
_FLAG_BY_FIELD = {field: flag for field, flag, _, _ in _FLAGS}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add our flags to SGLang's server parser (shown in ``--help``)."""
    defaults = SparseConfig()
    group = parser.add_argument_group(
        "sglang_ext sparse decode (used with --attention-backend sglang_ext)"
    )
    for field, flag, metavar, help_text in _FLAGS:
        default = getattr(defaults, field)
        group.add_argument(
            flag, dest=_dest(field), metavar=metavar, default=None,
            help=f"{help_text} Default: {default}.",
        )


def _dest(field: str) -> str:
    return f"sglang_ext_{field}"


def from_namespace(args: argparse.Namespace) -> SparseConfig:
    """Build and validate the config from parsed flags, falling back to $SGLANG_EXT_CONFIG."""
    raw: dict[str, Any] = {}
    env = os.environ.get(ENV_CONFIG)
    if env:
        try:
            raw.update(json.loads(env))
        except json.JSONDecodeError as e:
            raise ConfigError(f"${ENV_CONFIG} is not valid JSON: {e}") from None
        unknown = set(raw) - {f.name for f in dataclasses.fields(SparseConfig)}
        if unknown:
            raise ConfigError(f"${ENV_CONFIG} has unknown keys: {sorted(unknown)}")
    for field, _flag, _, _ in _FLAGS:
        value = getattr(args, _dest(field), None)
        if value is not None:
            raw[field] = value
    return build_config(**raw)


def build_config(**values: Any) -> SparseConfig:
    """Validate raw values (strings from the CLI, or typed values) into a SparseConfig."""
    defaults = SparseConfig()
    typed: dict[str, Any] = {}
    for f in dataclasses.fields(SparseConfig):
        value = values.get(f.name, getattr(defaults, f.name))
        typed[f.name] = _coerce(f.name, value, getattr(defaults, f.name))
    cfg = SparseConfig(**typed)
    _validate(cfg)
    return cfg


def _coerce(field: str, value: Any, default: Any) -> Any:
    flag = _FLAG_BY_FIELD[field]
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool):
            raise ConfigError(f"{flag} must be an integer (got {value!r})")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag} must be an integer (got {value!r})") from None
    if value is None:
        return None
    return str(value)


def _validate(cfg: SparseConfig) -> None:
    def fail(field: str, why: str) -> None:
        raise ConfigError(f"{_FLAG_BY_FIELD[field]} {why} (got {getattr(cfg, field)!r})")

    if cfg.method not in METHODS:
        fail("method", f"must be one of {', '.join(METHODS)}")
    if cfg.dense_backend not in DENSE_BACKENDS:
        fail("dense_backend", f"must be one of {', '.join(DENSE_BACKENDS)}")
    if cfg.impl not in IMPLS:
        fail("impl", f"must be one of {', '.join(IMPLS)}")
    if cfg.budget < 1:
        fail("budget", "must be a positive number of tokens")
    if cfg.block_size < 1 or cfg.block_size & (cfg.block_size - 1):
        fail("block_size", "must be a power of two")
    if cfg.candidate_blocks < 0:
        fail("candidate_blocks", "must be >= 0 (0 = auto)")
    if cfg.sink < 0:
        fail("sink", "must be >= 0")
    if cfg.window < 1:
        fail("window", "must be >= 1 (the current token is always attended)")
    if cfg.budget < cfg.sink + cfg.window:
        raise ConfigError(
            f"--sparse-budget must be >= --sparse-sink + --sparse-window "
            f"(got {cfg.budget} < {cfg.sink} + {cfg.window})"
        )
    if cfg.label_channels < 1:
        fail("label_channels", "must be >= 1")
    if cfg.label_config is not None and not os.path.isfile(cfg.label_config):
        fail("label_config", "is not a readable file")
