"""The chat page `streamfuse serve` answers at `/`: apps/web/'s three files, nothing fetched from outside.

    GET /                 index.html
    GET /web/{name}       app.js or style.css (a fixed list: any other name is a 404, so no path leaves apps/web/)

The page posts to /v1/chat/completions with `stream: true` and `streamfuse_steps: true`, and marks each token of
the answer as an accepted draft or a verified token as the chunks say (see apps/web/app.js). Every answer is
`no-cache` (a new install shows at once) and carries a Content-Security-Policy that allows only this server's own
scripts, styles and requests: no inline script, no frame, no other origin.
"""

from __future__ import annotations

from pathlib import Path

WEB = Path(__file__).parent / "web"
FILES = {  # name -> content type: the only files served
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def page_file(name: str):
    """One of FILES as a response with the page's headers; a 404 for any other name."""
    from starlette.exceptions import HTTPException
    from starlette.responses import Response

    if name not in FILES:
        raise HTTPException(404, "no such file of the page")
    return Response((WEB / name).read_bytes(), media_type=FILES[name], headers=HEADERS)


async def index(request):
    return page_file("index.html")


async def asset(request):
    return page_file(request.path_params["name"])


def routes() -> list:
    """The page's starlette routes, for create_app's list (GET answers HEAD too)."""
    from starlette.routing import Route

    return [Route("/", index, methods=["GET"]), Route("/web/{name}", asset, methods=["GET"])]
