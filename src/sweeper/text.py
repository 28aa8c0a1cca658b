"""Values as the user writes them: Hydra overrides, FLOPs, durations; secrets masked."""

from __future__ import annotations

import math
import re
from typing import Any

# a URI's password (postgresql://me:PASSWORD@host) and a credential in a query string
# (?password=..., &token=...): what `mask_secrets` replaces with ***
SECRETS = re.compile(
    r"(?P<lead>://[^/\s:@]*:)[^/\s@]+(?=@)"
    r"|(?P<key>[?&;](?:password|passwd|pwd|token|access_token|secret|api_key|apikey)=)[^&;\s]+",
    re.IGNORECASE,
)


def mask_secrets(text: str) -> str:
    """`text` with every password or token in a URI it holds replaced by ***: for what is
    printed, and every file and MLflow field a run leaves."""
    return SECRETS.sub(lambda m: (m.group("lead") or m.group("key")) + "***", text)


def hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return float_text(value) if isinstance(value, float) else str(value)


def rounded_text(value: Any) -> str:
    """4 significant digits for a float, written as an override would be (1e13, 2.5e-5);
    anything else as it is."""
    return float_text(float(f"{value:.4g}")) if isinstance(value, float) else str(value)


def float_text(value: float) -> str:
    """A float as a Hydra override reads it back exactly, in as few characters as it takes:
    1e15, not Python's 1000000000000000.0 (repr writes exponents only from 1e16 on), and
    exponents without a sign or a leading zero (2.5e-5, not 2.5e-05)."""
    text = repr(value)
    if "e" in text:
        mantissa, exponent = text.split("e")
        return f"{mantissa}e{int(exponent)}"
    if not math.isfinite(value) or abs(value) < 1e6:
        return text
    for digits in range(17):
        mantissa, exponent = f"{value:.{digits}e}".split("e")
        if float(f"{mantissa}e{exponent}") == value:
            short = f"{mantissa}e{int(exponent)}"
            return short if len(short) < len(text) else text
    return text


def flops_text(flops: float) -> str:
    """2.9e13, as the configs write FLOPs (not Python's 2.9e+13; 2.2e7, not 2.2e+07)."""
    mantissa, _, exponent = f"{flops:.3g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def duration_text(seconds: float | None) -> str:
    """'48 s', '4 min 48 s', '2 h 05 min'."""
    if seconds is None:
        return "an unknown time"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
