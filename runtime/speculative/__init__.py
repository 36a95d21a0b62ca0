"""DSpark speculative decoding in the offline engine: acceptance (accept.py), the state of
rejected tokens (rollback.py), the draft and verify programs (programs.py) and the decode loop
(decoder.py). docs/speculative.md describes the design."""
