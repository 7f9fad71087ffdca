"""The application: endpoints, error handling, ``/health``, the dashboard at ``/``.

:func:`create_app` takes a Redis client and the token; it holds no other state but the
marks cache (:mod:`.charts`). Interactive docs pages (Swagger, ReDoc) are off: they load
their scripts from a CDN; the OpenAPI document is at ``/openapi.json``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import redis
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from shoal.ops.api import errors
from shoal.ops.api.auth import TokenCheck
from shoal.ops.api.change_routes import routes as change_routes
from shoal.ops.api.charts import MarksCache
from shoal.ops.api.read_routes import router as read_router

#: Largest request body accepted (a job spec is a few KiB).
MAX_BODY = 1 << 20
STATIC = Path(str(files("shoal.ops.api") / "static"))
#: The dashboard loads nothing from elsewhere.
_DASHBOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shoal")
    except PackageNotFoundError:
        return "0+unknown"


def create_app(client: redis.Redis, *, token: str | None) -> FastAPI:
    """The API over ``client`` (any number of these may serve one Redis). With ``token``
    None every changing call is refused (read-only)."""
    app = FastAPI(title="shoal", version=_version(), docs_url=None, redoc_url=None,
                  description="Elastic PyTorch training coordinated through Redis: jobs, their status, log lines "
                              "and decisions, live. Changing calls need 'Authorization: Bearer <token>'.")
    app.state.client = client
    app.state.marks = MarksCache()
    check = TokenCheck(token)
    app.state.read_only = check.read_only
    errors.install(app)

    @app.middleware("http")
    async def _limits(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return JSONResponse({"detail": f"request body larger than {MAX_BODY} bytes"}, status_code=413)
        response = await call_next(request)
        if request.url.path == "/" or request.url.path.startswith("/static/"):
            response.headers.update(_DASHBOARD_HEADERS)
        return response

    @app.get("/health", summary="liveness and readiness: 200 when Redis answers, else 503")
    def health() -> JSONResponse:
        """``{"status": "ok", "redis": "ok", "read_only": ..., "version": ...}``; 503 with the
        reason in ``redis`` (and ``detail``) when Redis does not answer a PING."""
        base = {"read_only": check.read_only, "version": app.version}
        try:
            client.ping()
        except redis.RedisError as exc:
            reason = f"Redis unavailable: {errors.one_line(exc)}"
            return JSONResponse({"status": "unavailable", "redis": reason, "detail": reason, **base}, status_code=503)
        return JSONResponse({"status": "ok", "redis": "ok", **base})

    @app.get("/health/live", summary="liveness only: 200 while the process serves (Redis not asked)")
    def live() -> dict:
        """For a liveness probe: restarting this server does not bring Redis back, so only
        readiness (``/health``) should depend on it."""
        return {"status": "ok"}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.include_router(read_router)
    app.include_router(change_routes(check))
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
