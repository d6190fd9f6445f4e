"""The headers every answer of the admin pages, ``/metrics`` and ``/readyz`` carries, and the page's
inline style and script that its Content-Security-Policy pins by SHA-256.

The policy lets nothing load but that style and that script: no other script, no image, no framing,
forms post only to this origin. The style and script live here, beside the hashes computed from them,
so a change to either cannot leave the policy behind (the templates insert them as they are).
"""

from __future__ import annotations

import base64
import hashlib

from flask import request
from werkzeug.wrappers import Response as WerkzeugResponse

STYLE = """body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:4px 8px;text-align:left;vertical-align:top}pre{background:#f4f4f4;padding:1em}
.flash{background:#e8f4e8;padding:.5em}.error{background:#f8e0e0;padding:.5em}form{display:inline}"""
# The purge confirmation, as a script the CSP pins by hash (inline event handlers would need 'unsafe-hashes').
SCRIPT = """document.addEventListener("submit",function(e){var f=e.target;
if(f.classList&&f.classList.contains("purge-form")&&!confirm("Delete "+f.dataset.id+" for good?")){e.preventDefault();}});"""


def _sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; style-src {_sha256_source(STYLE)}; script-src {_sha256_source(SCRIPT)}; "
    "img-src 'none'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
# /metrics and /readyz answer text or JSON: nothing in them may load or be framed
NO_CONTENT_POLICY = "default-src 'none'; frame-ancestors 'none'"
HSTS = "max-age=31536000"


def security_headers(resp: WerkzeugResponse, *, csp: str = CONTENT_SECURITY_POLICY) -> WerkzeugResponse:
    """The headers every admin answer carries; a header the host app already set is kept."""
    resp.headers.setdefault("Content-Security-Policy", csp)
    resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    resp.headers.setdefault("Referrer-Policy", "no-referrer")
    resp.headers.setdefault("X-Frame-Options", "DENY")
    if request.is_secure:
        resp.headers.setdefault("Strict-Transport-Security", HSTS)
    return resp
