"""OpenAI's Batch API: input lines and the resumable results file (lines.py), `lmserve run-batch` (file.py),
jobs on disk (store.py), one job at a time on the server's loop (jobs.py) and /v1/files, /v1/batches (routes.py).

Each line goes through the OpenAI routes' own handling (`api` answers it), so a batch line is validated,
admitted and answered exactly as the live request would be.
"""
