"""Production workflow over the runtime: batch generation (:mod:`.batch`), the reference HTTP server
(:mod:`.server`, dynamic batching in :mod:`.scheduler`), Prometheus metrics (:mod:`.metrics`),
per-clip quality gates (:mod:`.quality`) and Ray fleets (:mod:`.ray_fleet`).

Importing this package loads nothing heavy; each module imports what it needs (FastAPI, uvicorn,
prometheus-client, Ray) when used: ``pip install 'trt_sora[serve]'`` (``[ray]`` for fleets).
"""
