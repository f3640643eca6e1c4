"""OpenAI's rate-limit headers, from the limiters the admission itself enforces.

Every answer of a tenant with limits, and every 429 it gets, carries OpenAI's six headers
(``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``), which clients (the ``openai``
SDKs, LangChain, LiteLLM) read to pace themselves, and the same three for the daily token
budget (``x-ratelimit-{limit,remaining,reset}-tokens-day``). A header is sent only for a limit
the tenant has.

The numbers are the state ``admit.lua`` leaves behind (it returns its limiters with its
verdict: no extra round trip), or, for a refusal before the admission (``quota_check.py``), the
state authentication read. NOTE: rpm and tpm are GCRA limiters (a burst of N, then one every
60/N s), which have no fixed window: "remaining" is what could be admitted at once (the part of
the minute not yet spoken for), and "reset" is when the limiter is whole again (the full limit
available). The day resets at midnight UTC.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

WINDOW_MS = 60_000
DAY_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class RateLimits:
    """A tenant's limiters at ``now_ms``: each limit (None: the tenant has none), the GCRA
    theoretical arrival times, and the tokens used today."""

    now_ms: float
    rpm: float | None = None
    rpm_tat: float = 0.0
    tpm: float | None = None
    tpm_tat: float = 0.0
    daily_tokens: float | None = None
    used_today: float = 0.0

    @classmethod
    def from_reply(cls, raw: list[Any]) -> RateLimits:
        """From ``admit.lua``'s limiters: rpm, rpm TAT, tpm, tpm TAT, daily_tokens, tokens used
        today, now (ms); "" for a limit the tenant does not have."""
        values = [_number(v) for v in raw]
        rpm, rpm_tat, tpm, tpm_tat, daily, used, now = values
        return cls(now or 0.0, rpm, rpm_tat or 0.0, tpm, tpm_tat or 0.0, daily, used or 0.0)

    def later(self, ms: float) -> RateLimits:
        """The same limiters ``ms`` later (nothing admitted meanwhile)."""
        return dataclasses.replace(self, now_ms=self.now_ms + ms) if ms else self

    def headers(self) -> dict[str, str]:
        """The headers of the limits the tenant has (none: an empty dict)."""
        out: dict[str, str] = {}
        for what, limit, tat in (("requests", self.rpm, self.rpm_tat),
                                 ("tokens", self.tpm, self.tpm_tat)):
            if not limit:
                continue
            behind_ms = max(tat - self.now_ms, 0.0)  # the part of the window spoken for
            remaining = math.floor((WINDOW_MS - behind_ms) * limit / WINDOW_MS + 1e-9)
            out[f"x-ratelimit-limit-{what}"] = str(int(limit))
            out[f"x-ratelimit-remaining-{what}"] = str(min(max(remaining, 0), int(limit)))
            out[f"x-ratelimit-reset-{what}"] = duration(behind_ms)
        if self.daily_tokens:
            next_day_ms = (math.floor(self.now_ms / DAY_MS) + 1) * DAY_MS
            out["x-ratelimit-limit-tokens-day"] = str(int(self.daily_tokens))
            out["x-ratelimit-remaining-tokens-day"] = str(
                max(int(self.daily_tokens - self.used_today), 0))
            out["x-ratelimit-reset-tokens-day"] = duration(next_day_ms - self.now_ms)
        return out


def duration(ms: float) -> str:
    """A duration as OpenAI writes it in these headers (Go's layout): ``17ms``, ``1.5s``,
    ``6m0s``, ``1h2m3s``."""
    if ms < 1000:
        return f"{math.ceil(ms)}ms" if ms > 0 else "0s"
    seconds = math.ceil(ms) / 1000
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    text = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes else text


def _number(raw: Any) -> float | None:
    if isinstance(raw, bytes):
        raw = raw.decode()
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        return None
