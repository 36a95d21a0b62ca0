"""Checkpoint I/O for the DeepSeek-V4 family: specs, reader, writer, synthetic weights, HF name mapping.

* :mod:`.spec`      - :class:`WeightSpec` (official name, shape, IR dtype; ``*`` = stacked experts),
  :func:`expand_spec`, :func:`validate_specs`, :func:`bytes_needed`, scale-pair builders.
* :mod:`.reader`    - :func:`open_checkpoint` -> :class:`Checkpoint` (``load``, ``check``, ``metadata``).
* :mod:`.writer`    - :func:`write_checkpoint` (official sharded layout, atomic).
* :mod:`.synthetic` - :func:`random_weights`, :func:`write_random_checkpoint`.
* :mod:`.hf_v4`     - transformers ``DeepseekV4ForCausalLM`` <-> official names, :func:`load_hf_layout`.
* :mod:`.errors`    - :class:`CheckpointError`, :class:`SpecError`.

Scales are explicit specs: a quantized ``X.weight`` is always declared with its ``X.scale``.
"""

from .errors import CheckpointError, SpecError
from .hf_v4 import (
    hf_state_dict_to_official,
    hf_to_official,
    load_hf_layout,
    official_to_hf,
    official_to_hf_state_dict,
)
from .reader import Checkpoint, TensorInfo, dequantize_tensor, open_checkpoint, read_header
from .spec import (
    WeightSpec,
    bytes_needed,
    expand_spec,
    fp4_expert_specs,
    fp8_linear_specs,
    scale_name,
    validate_specs,
    weight_name_for_scale,
    with_scales,
)
from .synthetic import random_weights, write_random_checkpoint
from .writer import plan_shards, shard_name, write_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "SpecError",
    "TensorInfo",
    "WeightSpec",
    "bytes_needed",
    "dequantize_tensor",
    "expand_spec",
    "fp4_expert_specs",
    "fp8_linear_specs",
    "hf_state_dict_to_official",
    "hf_to_official",
    "load_hf_layout",
    "official_to_hf",
    "official_to_hf_state_dict",
    "open_checkpoint",
    "plan_shards",
    "random_weights",
    "read_header",
    "scale_name",
    "shard_name",
    "validate_specs",
    "weight_name_for_scale",
    "with_scales",
    "write_checkpoint",
    "write_random_checkpoint",
]
