"""The shared harness of the product benchmarks (prefill.py, decode.py, kernels.py, ...) and the
probes under benchmarks/probes/.

* models: the tiny V4.1 model and the full-width V4.1-Flash layer slices, compiled for a hardware
  profile, with random weights in the release formats made on the device;
* engines: Engines over those weights with one of three kernel sets, a long cached context set as
  state (no prefill), the timed step loop;
* routing: balanced (round-robin) expert routing;
* optime: the per-op time split of one eager step, grouped into attention / MoE / mHC / other;
* costs: the FLOP and byte model of a step and its extrapolation to the 40 layers of V4.1-Flash;
* env: measured ceilings, the profile's peaks, the environment header;
* budget: the time budget that every benchmark run stays inside;
* sweep: modes x batch sizes, one engine per mode, failing soft;
* report: Markdown, plots and the result files (written atomically under results/<hw>/);
* cli: the command line and the run shared by prefill.py and decode.py.

`T0` is taken when the harness is first imported: the benchmarks import it before anything heavy,
so that `--time-budget` counts the imports too.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()
