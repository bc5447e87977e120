"""`python -m tests.serve_private_media serve ...`: `lmserve serve` whose MediaPolicy fetches from private addresses.

`MediaPolicy.allow_private` is the tests' switch (no flag sets it, so no deployment can): every address a test's
HTTP server can listen on here (loopback, the machine's 192.0.2.x) is refused as not public, so without it a fetch
never reaches the server and what happens after the connect (a redirect) cannot be seen through `serve`. Everything
else is the real server: the flags, the allow-list, the fetch threads and the refusals.
"""

from __future__ import annotations

import dataclasses
import sys

from lmserve.server import main as server_main

_policy = server_main.media_policy


def _private_allowed(args):
    return dataclasses.replace(_policy(args), allow_private=True)


server_main.media_policy = _private_allowed  # server_config looks it up at call time

if __name__ == "__main__":
    from lmserve.cli import main

    sys.exit(main())
