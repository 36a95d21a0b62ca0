"""Graph -> Graph compiler passes, the per-hardware pipeline and the artifact writer.

Importing this package registers every pass in `PASSES` (one module per pass).
"""

from . import (batch_window_copies, bounded_replay, cleanup, dspark_draft,  # noqa: F401
               encoder_replay, fuse_compressor, indexer_products, mega_mhc, mega_moe, partition,
               quantize_epilogues)
from .base import PASSES, Pass, PassError, PassResult, register_pass
from .hw import HwProfile, known_hw, load_hw_profile
from .pipeline import PIPELINE, CompileOptions, Compiled, compile_graph, compile_model

__all__ = ["PASSES", "Pass", "PassError", "PassResult", "register_pass", "HwProfile", "known_hw",
           "load_hw_profile", "PIPELINE", "CompileOptions", "Compiled", "compile_graph",
           "compile_model"]
