"""``shoal serve``: the HTTP API and the live web dashboard (FastAPI served by uvicorn).

The server reads and writes Redis only, through the same functions as the CLI
(:mod:`shoal.ops.jobs`, :mod:`shoal.ops.status`, :mod:`shoal.ops.streams`,
:mod:`shoal.ops.report`), and keeps no state beyond caches: any number of replicas can serve
the same Redis. Calls that change anything need ``Authorization: Bearer <token>``
(:mod:`.auth`); without a configured token the server is read-only. ``docs/api.md`` lists
the endpoints; ``/openapi.json`` describes them.

- :mod:`.app` builds the application (error handling, health, the dashboard's static files);
- :mod:`.read_routes` and :mod:`.change_routes` hold the endpoints;
- :mod:`.sse` turns a followed stream into Server-Sent Events;
- :mod:`.charts` gives the dashboard's charts their points and membership marks;
- :mod:`.serve` runs it (``shoal serve``).
"""
