"""The app's HTTP serving beside Gradio: an OpenAI-style `/v1/videos` API, a durable SQLite job store, metrics.

* `store`: every job (API and browser) with its request, owner, state, timings, files and error, in SQLite (WAL).
* `videos`: API fields -> `GenerationRequest` (the one checker's messages), Video objects.
* `jobs`: the one job service: runs the API's and the page's jobs on the engine front, follows them (SSE subscribers
  and the page's `JobView`s), recovers them after a restart.
* `api`: the FastAPI routes of /v1, /metrics, /healthz, /readyz; `options`: the flags; `webhooks`, `metrics`.

The same `EngineFront` and job service serve the UI and the API: one queue, one cancel, one store, one outputs folder.
"""
