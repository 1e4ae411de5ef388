"""Bounded JSON numbers: no number in a JSON answer runs past what a double can hold.

llguidance's JSON grammar allows numbers of any length, and a small model that starts a number
can loop on its digits until `max_tokens` (`0.33333…`, eighty digits long). A double has at most
17 significant digits and a three-digit exponent, so the mask also forbids, inside a number,
any token that would write (or, ending in `.`, call for) an 18th mantissa digit (a lone leading
`0` does not count) or a 4th exponent digit.

A `Scan` follows a JSON text byte by byte (inside a string or not, inside a number's mantissa or
exponent, and how many digits so far). `Digits` knows, per token, how many digits it would add
to each part, and gives the bit row of the tokens a number in a given state may take;
`grammar.bitmask` keeps only those in a row unless that would leave nothing allowed (a grammar
can demand a long number itself: a `const`, a huge `minimum`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

MANTISSA_DIGITS = 17
EXPONENT_DIGITS = 3

_OUTSIDE, _MANTISSA, _EXPONENT = 0, 1, 2
_DIGITS = frozenset(b"0123456789")
_MANTISSA_RUN = re.compile(rb"[0-9.]*")
_EXPONENT_RUN = re.compile(rb"[+-]?([0-9]*)")
_INTO_EXPONENT = re.compile(rb"[0-9.]*[eE][+-]?([0-9]*)")
_ENDS_STRING = re.compile(rb'["\\]')  # what can change the state inside a string
_STARTS_SOMETHING = re.compile(rb'["0-9-]')  # and outside a string and a number


@dataclass(frozen=True, slots=True)
class Scan:
    """Where a JSON text stands after the bytes fed so far."""

    in_string: bool = False
    escaped: bool = False
    part: int = _OUTSIDE  # outside a number, in its mantissa, or in its exponent
    digits: int = 0  # of the current part (-1 after a '-': a leading 0 is still free)

    def feed(self, text: bytes) -> Scan:
        """The state after `text` as well."""
        if self.in_string and not self.escaped:
            if not _ENDS_STRING.search(text):  # (most of a JSON answer's tokens)
                return self
        elif not self.in_string and self.part == _OUTSIDE and not _STARTS_SOMETHING.search(text):
            return self
        in_string, escaped, part, digits = self.in_string, self.escaped, self.part, self.digits
        for byte in text:
            if in_string:
                if escaped:
                    escaped = False
                elif byte == 0x5C:  # backslash
                    escaped = True
                elif byte == 0x22:  # quote
                    in_string = False
            elif byte == 0x22:
                in_string, part = True, _OUTSIDE
            elif part == _OUTSIDE and byte == 0x2D:  # '-': the first digit is still to come
                part, digits = _MANTISSA, -1
            elif part == _OUTSIDE and byte in _DIGITS:
                part, digits = _MANTISSA, int(byte != 0x30)
            elif part == _MANTISSA and byte in _DIGITS:
                digits = int(byte != 0x30) if digits < 0 else digits + 1
            elif part == _MANTISSA and byte in b"eE":
                part, digits = _EXPONENT, 0
            elif part == _EXPONENT and byte in _DIGITS:
                digits += 1
            elif not (part == _MANTISSA and byte == 0x2E) and not (
                part == _EXPONENT and byte in b"+-"
            ):
                part = _OUTSIDE
        return Scan(in_string, escaped, part, digits)

    @property
    def in_number(self) -> bool:
        return self.part != _OUTSIDE


class Digits:
    """Per token of one vocabulary: its bytes, and the digits it would add to a number."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        n = len(token_bytes)
        self._mantissa = np.zeros(n, dtype=np.int32)  # digits its leading [0-9.]* writes or needs
        self._exponent = np.zeros(n, dtype=np.int32)  # digits in its leading [+-]?[0-9]*
        self._into = np.zeros(n, dtype=np.int32)  # exponent digits it writes after an [eE]
        for t, text in enumerate(token_bytes):
            if not text:
                continue
            run = _MANTISSA_RUN.match(text).group()  # a trailing '.' asks for one more digit
            self._mantissa[t] = len(run) - run.count(b".") + run.endswith(b".")
            self._exponent[t] = len(_EXPONENT_RUN.match(text).group(1))
            into = _INTO_EXPONENT.match(text)
            if into:
                self._into[t] = len(into.group(1))
        self._allowed: dict[tuple[int, int], np.ndarray] = {}

    def allowed(self, scan: Scan) -> np.ndarray | None:
        """The bit row (int32 words, as `grammar.bitmask` lays them out) of the tokens a number
        in state `scan` may take; None outside a number."""
        if not scan.in_number:
            return None
        key = (scan.part, min(scan.digits, MANTISSA_DIGITS))
        bits = self._allowed.get(key)
        if bits is None:
            if scan.part == _MANTISSA:
                bad = (scan.digits + self._mantissa > MANTISSA_DIGITS) | (
                    self._into > EXPONENT_DIGITS
                )
            else:
                bad = scan.digits + self._exponent > EXPONENT_DIGITS
            bits = self._allowed[key] = _pack(~bad)
        return bits

    def fits(self, scan: Scan, token: int) -> bool:
        """Does `token` keep a number in state `scan` within its bounds (its bit in `allowed`)?"""
        bits = self.allowed(scan)
        return bits is None or bool(bits[token >> 5] >> (token & 31) & 1)


def _pack(flags: np.ndarray) -> np.ndarray:
    """Booleans per token as int32 words, token t at bit t % 32 of word t // 32."""
    words = (len(flags) + 31) // 32
    padded = np.ones(words * 32, dtype=bool)  # (past the vocabulary: as llguidance leaves it)
    padded[: len(flags)] = flags
    return np.packbits(padded, bitorder="little").view(np.int32)
