"""Per-key limits for bench_overhead's LiteLLM peer, without LiteLLM's database.

Every request's key is accepted (the benchmark sends one key per user, `sk-bench-<user>`) and
given the limits a virtual key would carry. They are far above the benchmark's rates, as
tollgate's are in examples/bench/tollgate.yaml: every request takes the whole limiter path and
none is refused.
"""

from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

RPM_LIMIT = 10_000_000
TPM_LIMIT = 10_000_000_000


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    if not api_key.startswith("sk-bench-"):
        raise Exception("unknown key")
    return UserAPIKeyAuth(api_key=api_key, rpm_limit=RPM_LIMIT, tpm_limit=TPM_LIMIT)
