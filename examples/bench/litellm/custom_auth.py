"""Per-key limits for bench_overhead's LiteLLM peer, without LiteLLM's database.

Every request's key is accepted (the benchmark sends one key per user, `sk-bench-<user>`) and
given the limits a virtual key would carry: BENCH_KEY_RPM_LIMIT and BENCH_KEY_TPM_LIMIT, which
the benchmark sets far above its rates (examples/bench_overhead.rs, `LITELLM_KEY_RPM_LIMIT`), so
every request takes the whole limiter path and none is refused.
"""

import os

from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

RPM_LIMIT = int(os.environ["BENCH_KEY_RPM_LIMIT"])
TPM_LIMIT = int(os.environ["BENCH_KEY_TPM_LIMIT"])


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    if not api_key.startswith("sk-bench-"):
        raise Exception("unknown key")
    return UserAPIKeyAuth(api_key=api_key, rpm_limit=RPM_LIMIT, tpm_limit=TPM_LIMIT)
