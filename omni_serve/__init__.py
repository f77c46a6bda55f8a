"""omni_serve: the HTTP server (OpenAI-compatible image and video endpoints).

It calls ``omni_diffusion``; nothing below it imports this package.

``omni-serve [MODEL] [--host] [--port] [--api-key] [--max-queue] [acceleration flags]``
(:mod:`omni_serve.cli`) runs FastAPI on uvicorn:

* ``GET /health`` (liveness), ``GET /health/ready`` (readiness, 503 until the worker is up),
  ``GET /metrics`` (Prometheus), ``GET /`` (playground page);
* ``GET /v1/models``; ``POST /v1/images/generations`` (``stream: true`` for server-sent
  ``progress`` events, one per step, then one OpenAI ``image_generation.completed`` event
  per image);
* ``POST /v1/videos`` (asynchronous job; a JSON body or the form OpenAI's SDK posts),
  ``GET /v1/videos`` (paged), ``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content``
  (MP4; ``?format=apng|frames``, ``?variant=thumbnail|spritesheet``),
  ``DELETE /v1/videos/{id}`` (cancels);
* ``GET /v1/files/{name}``: ``response_format="url"`` results (random names, time limit).

Modules: :mod:`~omni_serve.app` (``create_app``: wiring), :mod:`~omni_serve.routes`
(``system``, ``images``, ``videos``: the APIRouters), :mod:`~omni_serve.state` (what routes
share), :mod:`~omni_serve.errors`, :mod:`~omni_serve.middleware` (API key, body limit,
request metrics), :mod:`~omni_serve.files` (``url`` results), :mod:`~omni_serve.engine`
(bounded queue, jobs, batch dispatch to replicas, worker supervision),
:mod:`~omni_serve.batching`, :mod:`~omni_serve.worker` (the model process),
:mod:`~omni_serve.media` (MP4/APNG encoding), :mod:`~omni_serve.schemas` (request bounds),
:mod:`~omni_serve.metrics`, :mod:`~omni_serve.playground`.
"""

__version__ = "0.1.0"
