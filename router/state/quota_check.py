"""A tenant's quotas, looked at before the work they limit.

The admission script (``admit.lua``) is where rpm, tpm and the daily budget are enforced, with
the request's real token count; but it runs after the router has tokenized the prompt and
compiled its schema. A tenant already past a limit would make the router do that work for a
request that is then refused. So authentication, in the same round trip, reads the tenant's
limiters and refuses at once (429, the same reasons and Retry-After) a request that no token
count could let through: the rpm limiter full, the tpm limiter full even for one token, the day's
budget used up. It never consumes anything and errs on the side of letting through (a margin
for the router's clock against Redis's); the admission decides the rest.
"""

from __future__ import annotations

import math

from router.state.queues import refusal
from router.state.rate_limits import RateLimits

WINDOW_MS = 60_000
DAY_MS = 86_400_000
CLOCK_MARGIN_MS = 1_000  # the router's clock may run behind Redis's by this much


def _number(raw: bytes | None) -> float | None:
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None  # malformed: the admission script reports it


def refuse_if_exhausted(limits: list[bytes | None], tats: list[bytes | None],
                        used_today: bytes | None, now_ms: float) -> None:
    """``limits``: the tenant's rpm, tpm, daily_tokens; ``tats``: its GCRA rpm_tat, tpm_tat;
    ``used_today``: the tokens reserved or charged today. Raises ``RateLimitError`` when the
    next request cannot be admitted whatever its size."""
    rpm, tpm, daily = (_number(v) for v in limits)
    rpm_tat, tpm_tat = (_number(v) or 0.0 for v in tats)
    now = now_ms + CLOCK_MARGIN_MS  # as if later: never refuse what Redis would take
    waits: list[tuple[float, str]] = []
    if rpm:
        wait = max(rpm_tat, now) + WINDOW_MS / rpm - WINDOW_MS - now
        if wait > 0:
            waits.append((wait, "rpm"))
    if tpm:
        wait = max(tpm_tat, now) + WINDOW_MS / tpm - WINDOW_MS - now
        if wait > 0:
            waits.append((wait, "tpm"))
    used = _number(used_today) or 0.0
    if daily and used >= daily:
        waits.append(((math.floor(now_ms / DAY_MS) + 1) * DAY_MS - now_ms, "daily_budget"))
    if waits:
        wait, reason = max(waits)
        limits = RateLimits(now_ms, rpm, rpm_tat, tpm, tpm_tat, daily, used)
        # the admission's own message, reason and headers
        raise refusal(reason, math.ceil(wait), limits)
