"""Mixed-precision training: precision policies, emulated casts, loss scaling, master weights and
low-precision optimizer states, FP8 scaling recipes, numerics telemetry, checkpoints."""
from .casts import cast, round_to
from .checkpoint import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint
from .distributed import CompressedComm, compressed_allreduce_hook, fully_shard_with_policy
from .engine import Engine
from .fp8 import ScaledCast, mx_round, pow2_scale, scaled_round
from .optim import PackedState, StateStore, pack_state
from .policy import FP8_RECIPES, LOSS_SCALING, PRESETS, UPDATE_MODES, Policy
from .scaler import LossScaler
from .telemetry import Telemetry

__all__ = ["Policy", "PRESETS", "Engine", "LossScaler", "Telemetry", "cast", "round_to", "ScaledCast",
           "mx_round", "pow2_scale", "scaled_round", "PackedState", "StateStore", "pack_state",
           "save_checkpoint", "load_checkpoint", "read_checkpoint", "CheckpointError",
           "LOSS_SCALING", "FP8_RECIPES", "UPDATE_MODES",
           "CompressedComm", "compressed_allreduce_hook", "fully_shard_with_policy"]
