"""Running lmserve on platforms that run many replicas (Ray Serve); imports nothing of Ray until used.

`forward.py` is plain data and an ASGI bridge (no Ray), `router.py` the prefix-affinity request router,
`ray_serve.py` the Serve application (`serve run lmserve.deploy.ray_serve:app`).
"""
