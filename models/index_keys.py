"""The decode index-key reading of V4.1 (`index_key_reading`): which cache an index source scores
against on a decode row (docs/index-key-reading.md; spec §3.4.7).

* `owner` (the default): every index source scores against its own KV owner's index keys on every
  row, so decode == prefill (the architecture, and what prefill and training always do).
* `vendor`: what DeepSeek's released `inference/model.py` does. One module-level "published"
  index-key cache outlives each forward; a KV-source layer republishes its own cache only when its
  compressor closes a group in that forward, and an index source reads whatever was published last.
  On a decode row where a ratio-2 owner leaves its group open, layers 2/8/14 therefore score
  against the cache published before them: that of the last KV source of the previous token
  (layer 20, ratio 1, which republishes at every token), as that layer left it.

`vendor_reads` works the rule out per layer from the config by replaying the vendor's publishing
order over one period of token positions, so the graph carries plain structure: per affected index
source, one extra score against the published layer's index-key pool (a state input the graph
already has) and a per-row choice between the two.
"""

from __future__ import annotations

from math import lcm

from .config import INDEX_KEY_READINGS, ConfigError, ModelConfig

__all__ = ["INDEX_KEY_READINGS", "vendor_reads"]


def vendor_reads(cfg: ModelConfig) -> dict[int, int]:
    """{index-source layer: the KV-source layer whose index-key pool, as the step found it, that
    layer scores against under the vendor reading on a decode row whose KV owner leaves a group open}
    (V4.1-Flash: {2: 20, 8: 20, 14: 20}; empty where the vendor reading changes nothing).

    A decode row is one of a request that had cached tokens before the step; rows of a request's
    first chunk are the vendor's prefill, which reads the owner's keys. Layouts in which the vendor
    would read another layer's keys at prefill, or a cache written at the same token by a layer
    other than the owner, are not V4.1's and are refused with a ConfigError naming the layer."""
    src = cfg.source or "<config>"
    where = f"{src}: field 'index_key_reading': 'vendor'"
    if not cfg.is_v41:
        raise ConfigError(f"{where} describes V4.1's shared index keys; family {cfg.family} has none "
                          "(every compressed layer reads its own)")
    ratio = cfg.compress_ratios
    kv = sorted(cfg.kv_source_layers)
    if not kv:
        return {}
    period = lcm(*(ratio[s] for s in kv))
    top = max(ratio[s] for s in kv)

    def closes(s: int, p: int) -> bool:  # the compressor of s completes a group at position p
        return (p + 1) % ratio[s] == 0

    reads: dict[int, int] = {}
    for layer in sorted(cfg.index_source_layers):
        r = ratio[layer]
        owner = max(s for s in kv if s <= layer and ratio[s] == r)
        for n in range(r, top + 1):  # a first chunk of n tokens publishes the sources it closes
            last = max(s for s in kv if s <= layer and n >= ratio[s])
            if last != owner:
                raise ConfigError(f"{where}: at prefill, layer {layer}'s indexer would read layer "
                                  f"{last}'s index keys, not its owner {owner}'s; this layout is not "
                                  "V4.1's (use 'owner')")
        open_rows = set()
        for rho in range(period):  # decode rows at positions p = rho (mod period)
            same = [s for s in kv if s <= layer and closes(s, rho)]
            if same:
                if max(same) != owner:
                    raise ConfigError(f"{where}: layer {layer}'s indexer would read layer "
                                      f"{max(same)}'s keys written at the same token; this layout is "
                                      "not V4.1's (use 'owner')")
                continue
            back = next(q for q in range(rho - 1, rho - period - 1, -1)
                        if any(closes(s, q) for s in kv))
            last = max(s for s in kv if closes(s, back))
            if last == owner:  # the owner's keys as it left them: the owner reading
                continue
            if last < layer:
                raise ConfigError(f"{where}: layer {layer}'s indexer would read layer {last}'s keys, "
                                  "which this step may already have changed; this layout is not "
                                  "V4.1's (use 'owner')")
            if reads.setdefault(layer, last) != last:
                raise ConfigError(f"{where}: layer {layer}'s indexer would read two different "
                                  f"layers' keys ({reads[layer]}, {last}); not V4.1's (use 'owner')")
            open_rows.add(rho)
        if open_rows and open_rows != {rho for rho in range(period) if not closes(owner, rho)}:
            raise ConfigError(f"{where}: layer {layer}'s indexer would read layer {reads[layer]}'s keys "
                              "on some but not all rows where its owner leaves a group open; not "
                              "V4.1's (use 'owner')")
    return reads
