"""Request fields shared by /v1/chat/completions and /v1/completions, checked one by one so that a
bad value gets a 400 naming its field (OpenAI's ranges; vLLM/SGLang extensions `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`), and the logprob shapes of both APIs.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..sampling import SamplingError, SamplingParams
from .errors import APIError, bad_request, brief

_MISSING = object()


def _num(body: Mapping, key: str, lo: float, hi: float, default, *, integer: bool = False,
         lo_open: bool = False):
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or (not integer and not math.isfinite(v)):
        raise bad_request(key, f"must be {'an integer' if integer else 'a number'}, got {brief(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request(key, f"must be in {rng}, got {brief(v)}")
    return v


def parse_n(body: Mapping, max_n: int) -> int:
    return _num(body, "n", 1, max_n, 1, integer=True)


def parse_stop(body: Mapping) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or len(v) > 16:
        raise bad_request("stop", "must be a non-empty string or a list of at most 16 of them")
    return tuple(v)


def parse_logit_bias(body: Mapping, vocab: int) -> dict[int, float] | None:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise bad_request("logit_bias", "must be an object {token id: bias}")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise bad_request("logit_bias", f"key {brief(k)} is not a token id") from None
        if not 0 <= t < vocab:
            raise bad_request("logit_bias",
                              f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad_request("logit_bias", f"bias of token {t} must be a number in [-100, 100]")
        out[t] = float(b)
    return out or None


def sampling_params(body: Mapping, *, max_tokens: int, temperature: float, top_p: float,
                    seed, stop: tuple[str, ...], vocab: int) -> SamplingParams:
    """Runtime SamplingParams from the body's extension fields + the already-resolved ones."""
    top_k = _num(body, "top_k", -1, vocab, 0, integer=True)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < vocab for t in ids):
        raise bad_request("stop_token_ids", f"must be a list of token ids in 0..{vocab - 1}")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("ignore_eos", "must be a boolean")
    try:
        return SamplingParams(
            n=1, max_tokens=max_tokens, temperature=float(temperature), top_k=max(top_k, 0),
            top_p=float(top_p), min_p=float(_num(body, "min_p", 0, 1, 0.0)),
            repetition_penalty=float(_num(body, "repetition_penalty", 0, 2, 1.0, lo_open=True)),
            frequency_penalty=float(_num(body, "frequency_penalty", -2, 2, 0.0)),
            presence_penalty=float(_num(body, "presence_penalty", -2, 2, 0.0)),
            seed=seed, stop=stop, stop_token_ids=tuple(ids), ignore_eos=ignore_eos)
    except SamplingError as e:  # "SamplingParams.<field> ..."
        field = str(e).split(".", 1)[1].split(" ", 1)[0] if "." in str(e) else None
        raise bad_request(field, str(e)) from None


def parse_seed(body: Mapping):
    v = body.get("seed")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not -2**63 <= v < 2**63:
        raise bad_request("seed", "must be a 64-bit integer")
    return v


def context_error(param: str, capacity: int, prompt: int, completion: int) -> APIError:
    return APIError(400, f"This model's maximum context length is {capacity} tokens. However, "
                    f"you requested {prompt + completion} tokens ({prompt} in the {param}, "
                    f"{completion} in the completion). Please reduce the length of the {param} "
                    f"or completion.", param, "context_length_exceeded")


# ----------------------------------------------------------------------------------- logprobs
def chat_logprobs(service, lps) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` entries."""
    out = []
    for lp in lps or ():
        text, b = service.token_text(lp.token_id)
        top = []
        for tid, v in lp.top:
            t, tb = service.token_text(tid)
            top.append({"token": t, "logprob": v, "bytes": tb})
        out.append({"token": text, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
    return out


def completion_logprobs(service, lps, offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object for `lps`, text offsets from `offset`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps or ():
        text, _ = service.token_text(lp.token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({service.token_text(t)[0]: v for t, v in lp.top})
        offsets.append(offset)
        if lp.token_id not in (service._skip or ()):  # skipped specials add no text
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
